"""`TokenizerPool`: tokenizing and chat templating off the event loop and off the engine thread."""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from blockserve.engine.chat import Message
from blockserve.engine.input_processor import InputProcessor
from blockserve.errors import ServerOverloadedError
from blockserve.multimodal.inputs import ImageInput

T = TypeVar("T")


class TokenizerPool:
    """Runs `fn(processor)` on one of `workers` threads, with at most `max_pending` calls
    queued or running: past that a call is refused (ServerOverloadedError, a 503 with
    Retry-After) rather than queued behind work it would wait seconds for.

    Tokenizing a long prompt takes a while (up to seconds for megabytes of text): on the event loop
    it would stall every other request's I/O, on the engine thread every step. A few worker
    threads do it instead, all with the one `InputProcessor`: its tokenizer serves many threads
    at once (model/tokenizer.py). The Rust tokenizer lets go of the GIL while it encodes, so the
    loop keeps serving meanwhile: a big prompt costs its own latency, not its neighbours'.
    """

    def __init__(self, processor: InputProcessor, workers: int, max_pending: int = 0) -> None:
        if workers < 1:
            raise ValueError(f"a tokenizer pool needs at least one worker, got {workers}")
        self.processor = processor
        self.max_pending = max_pending or 64 * workers
        self._pending = 0  # read and written on the event loop only
        self._executor = concurrent.futures.ThreadPoolExecutor(
            workers, thread_name_prefix="blockserve-tokenizer"
        )

    async def run(self, fn: Callable[[InputProcessor], T]) -> T:
        """`fn` applied to the processor on a worker, awaited without blocking the loop."""
        if self._pending >= self.max_pending:
            raise ServerOverloadedError(
                f"{self._pending} requests are being tokenized or wait for it; try again shortly"
            )
        self._pending += 1
        try:
            return await asyncio.wrap_future(self._executor.submit(fn, self.processor))
        finally:
            self._pending -= 1

    def shutdown(self) -> None:
        """Stop the workers; calls still queued are cancelled."""
        self._executor.shutdown(wait=False, cancel_futures=True)


class PoolTokenizing:
    """The `EngineClient` calls that only tokenize, answered on `self._tokenizers`; shared by
    every client that owns a pool (the engine's, the cluster ingress's)."""

    _tokenizers: TokenizerPool

    async def tokenize(self, text: str, add_special_tokens: bool = True) -> tuple[int, ...]:
        """`text`'s token ids, on a tokenizer worker; text that cannot fit the context is
        refused (InvalidRequestError) before it is tokenized."""
        return await self._tokenizers.run(lambda p: p.encode_text(text, add_special_tokens))

    async def tokenize_chat(
        self,
        messages: Sequence[Message],
        add_generation_prompt: bool = True,
        special_tokens_in_content: bool = False,
        tools: Sequence[dict[str, Any]] | None = None,
    ) -> tuple[int, ...]:
        """A conversation's prompt token ids under the chat template, on a tokenizer worker."""
        return await self._tokenizers.run(
            lambda p: p.chat_prompt(
                messages, add_generation_prompt, special_tokens_in_content, tools
            )
        )

    async def tokenize_image_chat(
        self,
        messages: Sequence[dict[str, Any]],
        add_generation_prompt: bool = True,
        special_tokens_in_content: bool = False,
        tools: Sequence[dict[str, Any]] | None = None,
    ) -> tuple[tuple[int, ...], tuple[ImageInput, ...]]:
        """A conversation with image parts: its prompt token ids and its images (decoded and
        processed), on a tokenizer worker."""
        return await self._tokenizers.run(
            lambda p: p.image_chat_prompt(
                messages, add_generation_prompt, special_tokens_in_content, tools
            )
        )

    async def detokenize(self, token_ids: Sequence[int]) -> str:
        return await self._tokenizers.run(lambda p: str(p.tokenizer.decode(list(token_ids))))
