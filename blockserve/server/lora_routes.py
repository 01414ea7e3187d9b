"""vLLM's runtime LoRA routes, served with --allow-runtime-lora-updating only (a request names
a path the server reads): POST /v1/load_lora_adapter and /v1/unload_lora_adapter."""

from __future__ import annotations

import logging

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse

from blockserve.server.body import Body
from blockserve.server.context import ServingContext


class LoadLoRAAdapterRequest(Body):
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(Body):
    lora_name: str


logger = logging.getLogger("blockserve")


def add_lora_routes(app: FastAPI, ctx: ServingContext) -> None:
    logger.warning(
        "LoRA adapters may be loaded and unloaded at run time (POST /v1/load_lora_adapter, "
        "/v1/unload_lora_adapter): a request names a path the server reads. As vLLM says, "
        "for local development only"
    )

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> PlainTextResponse:
        """Read and check the adapter off the engine's thread, then serve it; a 400 naming
        the reason (nothing changed) when it cannot be served."""
        ctx.check_adapter_name(body.lora_name)
        await ctx.engine.load_lora(body.lora_name, body.lora_path)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest) -> PlainTextResponse:
        """Refused (400) while running or waiting requests use the adapter; 404 if unknown."""
        await ctx.engine.unload_lora(body.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
