"""`ServingContext`: what every route of one server shares (the engine client, the served
names and adapters, the options that shape replies, the drain, the request limits)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from blockserve.engine.client import EngineClient
from blockserve.errors import InvalidRequestError, ModelNotFoundError
from blockserve.sampling_params import SamplingParams
from blockserve.server.auth import salt_for_key
from blockserve.server.drain import Drain
from blockserve.server.metrics import ServerMetrics
from blockserve.server.request_limits import RequestLimits


@dataclass(frozen=True)
class ServingContext:
    engine: EngineClient
    model_name: str  # the first served name: what responses and metrics report
    tokenizer: Any  # the model's (ModelInfo.tokenizer), for a token's text on the event loop
    metrics: ServerMetrics
    salt_per_key: bool = False  # --cache-salt-per-key
    default_chat_max_tokens: int = 2048  # --default-chat-max-tokens
    trust_chat_special_tokens: bool = False  # --trust-chat-special-tokens
    response_role: str = "assistant"  # --response-role
    drain: Drain = field(default_factory=lambda: Drain(0.0))
    served_names: tuple[str, ...] = ()  # every name a request may use
    # --tool-call-parser when --enable-auto-tool-choice is on: tool_choice "auto" reads calls
    # out of the model's text in this format (None: "auto" is refused).
    tool_call_parser: str | None = None
    # The model's generation-config defaults (--generation-config): field -> value.
    default_sampling: Mapping[str, float | int] = field(default_factory=dict)
    limits: RequestLimits = field(default_factory=RequestLimits)  # what one request may ask
    stream_write_timeout_s: float = 30.0  # --stream-write-timeout

    def check_limits(self, params: SamplingParams, prompts: Sequence[str | Sequence[int]]) -> None:
        """InvalidRequestError if the request asks for more than `limits` allow."""
        self.limits.check(params, prompts, self.engine.model_info().max_model_len)

    def cache_salt(self, request: Request, client_salt: str | None) -> str | None:
        """The salt a request runs under: the client's, or with per-key salts one derived
        from the API key the request showed."""
        if not self.salt_per_key:
            return client_salt
        return salt_for_key(request.state.api_key, client_salt)

    def check_model(self, model: str | None) -> str | None:
        """The LoRA adapter `model` names, or None for the base model; ModelNotFoundError
        (a 404) for a name nothing is served under."""
        if model is None or model == self.model_name or model in self.served_names:
            return None
        if model in self.engine.model_info().lora_adapters:  # the engine's registry, now
            return model
        raise ModelNotFoundError(f"The model `{model}` does not exist.")

    def check_adapter_name(self, name: str) -> None:
        """InvalidRequestError for an adapter name a served model already has: the base
        model's names always mean the base model."""
        if name == self.model_name or name in self.served_names:
            raise InvalidRequestError(
                f"the LoRA adapter name {name!r} is a served model's name", "lora_name"
            )
