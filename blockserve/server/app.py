"""The FastAPI app factory: routes, auth, errors, metrics, and the engine's lifetime.

The app talks to the engine only through an `EngineClient` (engine/client.py): it reads no
engine internals and imports nothing below the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse, PlainTextResponse

from blockserve import __version__
from blockserve.engine.client import EngineClient, ModelInfo
from blockserve.errors import InvalidConfigError, InvalidRequestError
from blockserve.server.auth import RequireApiKey, describe_access
from blockserve.server.completions import create_completion
from blockserve.server.context import ServingContext
from blockserve.server.drain import Drain, RefuseWhileDraining
from blockserve.server.errors import install_error_handlers, openapi_schema
from blockserve.server.limits import BodySizeLimit
from blockserve.server.lora_routes import add_lora_routes
from blockserve.server.metrics import ServerMetrics, log_stats_periodically
from blockserve.server.openai_routes import chat_prompt, create_chat_completion
from blockserve.server.options import ServerConfig
from blockserve.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from blockserve.server.request_limits import RequestLimits

logger = logging.getLogger("blockserve")

# A completion answers JSON, or with "stream": true an event stream.
GENERATION_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "The completion, or its server-sent events when streaming.",
        "content": {"application/json": {}, "text/event-stream": {}},
    }
}


def build_app(engine: EngineClient, config: ServerConfig) -> FastAPI:
    """An app serving `engine`; the engine starts and stops with the app."""
    info = engine.model_info()
    served_names = config.served_model_name or (info.name,)
    model_name = served_names[0]
    ctx = ServingContext(
        engine=engine,
        model_name=model_name,
        tokenizer=info.tokenizer,
        metrics=ServerMetrics(engine, model_name),
        salt_per_key=config.cache_salt_per_key,
        default_chat_max_tokens=config.default_chat_max_tokens,
        trust_chat_special_tokens=config.trust_chat_special_tokens,
        response_role=config.response_role,
        drain=Drain(config.shutdown_timeout),
        served_names=served_names,
        default_sampling=info.default_sampling,
        tool_call_parser=config.tool_call_parser if config.enable_auto_tool_choice else None,
        limits=_request_limits(config),
        stream_write_timeout_s=config.stream_write_timeout,
    )
    for name in info.lora_adapters:
        if name in served_names:
            raise InvalidConfigError(f"--lora-modules: {name!r} is a served model's name")

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        stats_task = None
        if not config.disable_log_stats:
            stats = log_stats_periodically(engine, config.stats_interval_s)
            stats_task = asyncio.create_task(stats)
        try:
            yield
        finally:
            if stats_task is not None:
                stats_task.cancel()
            await asyncio.to_thread(engine.shutdown)

    app = FastAPI(title="blockserve", version=__version__, lifespan=lifespan)
    install_error_handlers(app)
    app.state.drain = ctx.drain
    # Outermost last: keys first, then the drain, then the body limit.
    app.add_middleware(
        BodySizeLimit, max_bytes=config.max_request_body_bytes, timeout_s=config.body_timeout
    )
    app.add_middleware(RefuseWhileDraining, drain=ctx.drain)
    open_paths = None
    if config.api_key:
        open_paths = frozenset(
            {"/health"} | ({"/metrics"} if config.metrics_without_auth else set())
        )
        app.add_middleware(RequireApiKey, keys=config.api_key, open_paths=open_paths)
    logger.info(describe_access(config))
    _add_openai_routes(app, ctx, info)
    _add_token_routes(app, ctx, info)
    _add_status_routes(app, ctx)
    if config.enable_debug_endpoints:
        _add_debug_routes(app, ctx)
    if config.allow_runtime_lora_updating:
        add_lora_routes(app, ctx)
    app.openapi = lambda: openapi_schema(app, open_paths)  # type: ignore[method-assign]
    return app


def _request_limits(config: ServerConfig) -> RequestLimits:
    return RequestLimits(
        max_prompts_per_request=config.max_prompts_per_request,
        max_stop_strings=config.max_stop_strings,
        max_stop_chars=config.max_stop_chars,
        max_request_tokens=config.max_request_tokens,
    )


def _add_openai_routes(app: FastAPI, ctx: ServingContext, info: ModelInfo) -> None:
    created = int(time.time())  # the model is served from the moment the app is built

    @app.post("/v1/completions", response_model=None, responses=GENERATION_RESPONSES)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await create_completion(ctx, body, request)

    @app.post("/v1/chat/completions", response_model=None, responses=GENERATION_RESPONSES)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await create_chat_completion(ctx, body, request)

    @app.get("/v1/models")
    async def models() -> dict:
        cards = [
            {
                "id": name,
                "object": "model",
                "created": created,
                "owned_by": "blockserve",
                "max_model_len": info.max_model_len,
            }
            for name in ctx.served_names
        ]
        cards += [
            {
                "id": name,
                "object": "model",
                "created": created,
                "owned_by": "blockserve",
                "root": path,
                "parent": ctx.model_name,
                "max_model_len": info.max_model_len,
            }
            for name, path in info.lora_adapters.items()  # the engine's registry, now
        ]
        return {"object": "list", "data": cards}


def _add_token_routes(app: FastAPI, ctx: ServingContext, info: ModelInfo) -> None:
    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict:
        ctx.check_model(body.model)
        if body.messages is not None:
            tokens, _ = await chat_prompt(ctx, ChatCompletionRequest(messages=body.messages))
        else:
            assert body.prompt is not None
            tokens = await ctx.engine.tokenize(body.prompt, body.add_special_tokens)
        return {"count": len(tokens), "max_model_len": info.max_model_len, "tokens": tokens}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict:
        ctx.check_model(body.model)
        if any(not 0 <= t < info.vocab_size for t in body.tokens):
            raise InvalidRequestError(f"token ids must be in [0, {info.vocab_size})", "tokens")
        return {"prompt": await ctx.engine.detokenize(body.tokens)}


def _add_status_routes(app: FastAPI, ctx: ServingContext) -> None:
    @app.get(
        "/health",
        response_class=Response,
        responses={
            200: {"description": "The engine is running. Empty body.", "content": {}},
            503: {"description": "The engine is dead. Empty body.", "content": {}},
        },
    )
    async def health() -> Response:
        healthy = ctx.engine.is_healthy() and not ctx.drain.draining
        return Response(status_code=200 if healthy else 503)

    @app.get(
        "/metrics",
        response_class=PlainTextResponse,
        responses={200: {"description": "Prometheus' text format.", "content": {"text/plain": {}}}},
    )
    async def metrics() -> Response:
        return PlainTextResponse(ctx.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/version")
    async def version() -> dict:
        """The version, and where the engine runs: device, ISA level, dtype, threads."""
        return {"version": __version__, **ctx.engine.model_info().runtime}


def _add_debug_routes(app: FastAPI, ctx: ServingContext) -> None:
    @app.get("/debug/kv_cache")
    async def kv_cache() -> JSONResponse:
        """Pool occupancy and its integrity check, computed between two engine steps."""
        return JSONResponse(dataclasses.asdict(await ctx.engine.debug_kv_cache()))

    @app.get("/debug/miss_ratio_curve")
    async def miss_ratio_curve() -> JSONResponse:
        """The estimated LRU prefix-cache hit rate at 1/16x to 16x this cache's size, over
        all traffic since start, beside this cache's own hit rate."""
        return JSONResponse(dataclasses.asdict(await ctx.engine.debug_miss_ratio_curve()))
