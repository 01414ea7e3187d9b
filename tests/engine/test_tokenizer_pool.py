"""The tokenizer pool: prompts are tokenized on its own threads, with the one tokenizer, and a
long tokenization holds up neither the event loop nor a short one beside it."""

from __future__ import annotations

import asyncio
import threading
from typing import ClassVar

import pytest

from blockserve.engine.input_processor import InputProcessor
from blockserve.engine.tokenizer_pool import TokenizerPool
from blockserve.errors import ServerOverloadedError

WAIT_S = 10


class GatedTokenizer:
    """One token per character. Encoding "slow..." waits for `gate`; every encode records
    the thread it ran on and the tokenizer object that ran it."""

    gate: ClassVar[threading.Event] = threading.Event()
    calls: ClassVar[list[tuple[str, int]]] = []

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if text.startswith("slow"):
            assert self.gate.wait(WAIT_S), "the gate was never opened"
        self.calls.append((threading.current_thread().name, id(self)))
        return [ord(c) % 100 for c in text]


def make_pool(workers: int) -> tuple[TokenizerPool, GatedTokenizer]:
    tokenizer = GatedTokenizer()
    processor = InputProcessor(
        tokenizer, vocab_size=100, max_model_len=64, scheduling_policy="fcfs", max_n=1
    )
    return TokenizerPool(processor, workers), tokenizer


def test_work_runs_on_pool_threads_with_the_one_tokenizer() -> None:
    """Never on the caller's thread; every call, on whichever worker, with the processor's
    own tokenizer (it serves many threads: nothing is copied)."""
    pool, original = make_pool(workers=2)
    GatedTokenizer.gate.set()
    GatedTokenizer.calls.clear()

    async def main() -> list[tuple[int, ...]]:
        return list(
            await asyncio.gather(*(pool.run(lambda p: p.encode_text("ab")) for _ in range(8)))
        )

    try:
        assert asyncio.run(main()) == [(97, 98)] * 8
    finally:
        pool.shutdown()
    threads = {name for name, _ in GatedTokenizer.calls}
    assert threads and all(name.startswith("blockserve-tokenizer") for name in threads)
    assert [tokenizer for _, tokenizer in GatedTokenizer.calls] == [id(original)] * 8


def test_a_short_prompt_does_not_wait_for_a_long_one() -> None:
    """While one worker is stuck in a long tokenization, the loop runs and the other worker
    finishes a short prompt; the long one completes once released."""
    pool, _ = make_pool(workers=2)
    GatedTokenizer.gate.clear()

    async def main() -> None:
        slow = asyncio.ensure_future(pool.run(lambda p: p.encode_text("slow text")))
        short = await asyncio.wait_for(pool.run(lambda p: p.encode_text("hi")), WAIT_S)
        assert short == (4, 5) and not slow.done()
        GatedTokenizer.gate.set()
        assert len(await asyncio.wait_for(slow, WAIT_S)) == len("slow text")

    try:
        asyncio.run(main())
    finally:
        GatedTokenizer.gate.set()
        pool.shutdown()


def test_a_pool_needs_a_worker() -> None:
    with pytest.raises(ValueError, match="at least one worker, got 0"):
        make_pool(workers=0)


def test_a_full_queue_refuses_with_retry_after_and_frees_as_work_ends() -> None:
    """Two calls pending (one running, one queued) fill a pool of max_pending 2: a third is
    ServerOverloadedError (503, Retry-After 1 s); once they end, a call is taken again."""
    tokenizer = GatedTokenizer()
    processor = InputProcessor(
        tokenizer, vocab_size=100, max_model_len=64, scheduling_policy="fcfs", max_n=1
    )
    pool = TokenizerPool(processor, workers=1, max_pending=2)
    GatedTokenizer.gate.clear()

    async def main() -> None:
        held = [
            asyncio.ensure_future(pool.run(lambda p: p.encode_text("slow text"))) for _ in range(2)
        ]
        await asyncio.sleep(0)
        with pytest.raises(ServerOverloadedError) as refused:
            await pool.run(lambda p: p.encode_text("hi"))
        assert (refused.value.http_status, refused.value.retry_after_s) == (503, 1)
        GatedTokenizer.gate.set()
        await asyncio.wait_for(asyncio.gather(*held), WAIT_S)
        assert await pool.run(lambda p: p.encode_text("hi")) == (4, 5)

    try:
        asyncio.run(main())
    finally:
        GatedTokenizer.gate.set()
        pool.shutdown()
