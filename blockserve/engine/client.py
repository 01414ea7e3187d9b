"""`EngineClient`: everything a front end (the HTTP server) may ask of an engine.

The server speaks to the engine through this protocol alone; `AsyncEngine` implements it.
Every value that crosses it is plain data, or the model's tokenizer (which any thread may use).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from blockserve.engine.chat import Message
from blockserve.engine.outputs import EngineStats, KVCacheReport, MissRatioReport, RequestOutput
from blockserve.engine.request import RequestSpec
from blockserve.model.tokenizer import Tokenizer
from blockserve.multimodal.inputs import ImageInput


@dataclass(frozen=True)
class ModelInfo:
    """The served model as a client sees it. `tokenizer` is for short decodes on the
    event-loop thread (a token's text); long work goes through `tokenize`."""

    name: str
    max_model_len: int
    vocab_size: int
    tokenizer: Tokenizer
    # Defaults from the model's generation config: request field -> value (max_tokens a cap).
    default_sampling: Mapping[str, float | int] = field(default_factory=dict)
    # Where the engine runs (device, ISA level, dtype, threads), for /version.
    runtime: Mapping[str, str | int | bool] = field(default_factory=dict)
    # The LoRA adapters served now, name -> path: the engine's registry (lora/registry.py),
    # which loads and unloads change; a cluster's ingress holds the replicas' --lora-modules.
    lora_adapters: Mapping[str, str] = field(default_factory=dict)


class EngineClient(Protocol):
    def start(self) -> None:
        """Start serving; outputs are delivered to the running event loop."""

    def shutdown(self) -> None:
        """Stop: in-flight requests are aborted, resources released."""

    def generate(self, spec: RequestSpec) -> AsyncIterator[RequestOutput]:
        """A snapshot of the request after every step that changed it, the last finished.
        InvalidRequestError before any output if the spec is refused; closing the iterator
        early aborts the request."""

    def abort(self, request_id: str) -> None:
        """End a request; its blocks are freed before the engine's next step."""

    async def tokenize(self, text: str, add_special_tokens: bool = True) -> tuple[int, ...]:
        """Token ids of `text`, off the event loop; text that cannot fit the context is
        refused before it is tokenized."""

    async def tokenize_chat(
        self,
        messages: Sequence[Message],
        add_generation_prompt: bool = True,
        special_tokens_in_content: bool = False,
        tools: Sequence[dict[str, Any]] | None = None,
    ) -> tuple[int, ...]:
        """A conversation's prompt token ids under the model's chat template (given `tools`
        to render), off the event loop; special-token text inside a message stays plain text
        unless `special_tokens_in_content`."""

    async def tokenize_image_chat(
        self,
        messages: Sequence[dict[str, Any]],
        add_generation_prompt: bool = True,
        special_tokens_in_content: bool = False,
        tools: Sequence[dict[str, Any]] | None = None,
    ) -> tuple[tuple[int, ...], tuple[ImageInput, ...]]:
        """A conversation whose contents hold image parts (`{"type": "image", "url":
        "data:..."}`): its prompt token ids and its images, decoded off the event loop;
        refused by a model that takes no images."""

    async def detokenize(self, token_ids: Sequence[int]) -> str:
        """The text of token ids (each inside the vocabulary), off the event loop."""

    def is_healthy(self) -> bool: ...

    def model_info(self) -> ModelInfo: ...

    def stats(self) -> EngineStats:
        """The counters as of the last step boundary (never read mid-step)."""

    async def load_lora(self, name: str, path: str) -> None:
        """Serve the adapter at `path` under `name` (--allow-runtime-lora-updating)."""

    async def unload_lora(self, name: str) -> None:
        """Stop serving an adapter no request uses."""

    async def debug_kv_cache(self) -> KVCacheReport:
        """The block pool's occupancy and integrity, computed between two steps."""

    async def debug_miss_ratio_curve(self) -> MissRatioReport:
        """The online miss-ratio curve at 17 cache sizes, computed between two steps."""
