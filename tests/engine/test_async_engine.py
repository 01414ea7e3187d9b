"""The async engine: concurrent streams, early close aborts, typed refusals, shutdown."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import pytest

from blockserve.engine.args import EngineArgs
from blockserve.engine.async_engine import AsyncEngine
from blockserve.engine.outputs import RequestOutput
from blockserve.engine.request import RequestSpec
from blockserve.errors import EngineDeadError, InvalidRequestError
from blockserve.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def make_engine(model_dir: Path) -> AsyncEngine:
    args = EngineArgs(model=str(model_dir), dtype="float32", num_gpu_blocks_override=128)
    return AsyncEngine.from_config(args.create_configs())


async def collect(engine: AsyncEngine, request_id: str, prompt: list[int]) -> list[RequestOutput]:
    return [out async for out in engine.generate(RequestSpec(request_id, tuple(prompt), GREEDY))]


def test_concurrent_streams_finish_with_their_own_tokens(tiny_llama_dir: Path) -> None:
    """Four concurrent requests each stream growing snapshots and end finished."""
    engine = make_engine(tiny_llama_dir)

    async def main() -> list[list[RequestOutput]]:
        engine.start()
        try:
            return await asyncio.gather(
                *(collect(engine, f"r{i}", list(range(i, i + 20))) for i in range(4))
            )
        finally:
            engine.shutdown()

    streams = asyncio.run(main())
    for stream in streams:
        assert stream[-1].finished and not any(o.finished for o in stream[:-1])
        lengths = [len(o.outputs[0].token_ids) for o in stream]
        assert lengths == sorted(lengths) and lengths[-1] == 8
    assert streams[0][-1].outputs[0].token_ids != streams[1][-1].outputs[0].token_ids


def test_closing_a_stream_aborts_the_request(tiny_llama_dir: Path) -> None:
    """A consumer that stops reading aborts its request; its blocks are freed."""
    engine = make_engine(tiny_llama_dir)
    long = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)

    async def main() -> None:
        engine.start()
        try:
            stream = engine.generate(RequestSpec("long", tuple(range(40)), long))
            async for output in stream:
                if len(output.outputs[0].token_ids) >= 2:
                    break
            await stream.aclose()
            deadline = time.monotonic() + 5
            while engine.stats().num_running and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            stats = engine.stats()
            assert (stats.num_running, stats.num_waiting, stats.kv_cache_usage) == (0, 0, 0.0)
            report = await engine.debug_kv_cache()
            assert (report.num_requests_holding_blocks, report.integrity_errors) == (0, ())
            assert engine.is_healthy()
        finally:
            engine.shutdown()

    asyncio.run(main())


def test_refused_request_raises_typed_error(tiny_llama_dir: Path) -> None:
    """A bad request raises InvalidRequestError from generate; the engine keeps serving."""
    engine = make_engine(tiny_llama_dir)

    async def main() -> RequestOutput:
        engine.start()
        try:
            with pytest.raises(InvalidRequestError, match="out of range"):
                await collect(engine, "bad", [10**9])
            return (await collect(engine, "good", [1, 2, 3]))[-1]
        finally:
            engine.shutdown()

    assert asyncio.run(main()).finished


def test_shutdown_stops_the_engine(tiny_llama_dir: Path) -> None:
    """After shutdown the engine is unhealthy and refuses new requests with EngineDeadError."""
    engine = make_engine(tiny_llama_dir)

    async def main() -> None:
        engine.start()
        assert engine.is_healthy()
        engine.shutdown()
        assert not engine.is_healthy()
        with pytest.raises(EngineDeadError):
            await collect(engine, "late", [1, 2, 3])

    asyncio.run(main())


def test_a_dead_engine_loop_fails_streams_and_refuses_new_requests(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An error escaping the step loop kills the engine: the running stream ends with
    EngineDeadError naming the error's type but not its text (which may quote another
    request), health turns false, and a new request is refused at once (not a hang)."""
    engine = make_engine(tiny_llama_dir)

    def broken_step() -> list[RequestOutput]:
        raise RuntimeError("the loop itself broke")

    monkeypatch.setattr(engine.engine, "step", broken_step)

    async def main() -> None:
        engine.start()
        try:
            with pytest.raises(EngineDeadError) as died:
                await asyncio.wait_for(collect(engine, "running", [1, 2, 3]), timeout=10)
            assert str(died.value) == (
                "the engine loop died (RuntimeError); the server log has details"
            )
            assert not engine.is_healthy()
            with pytest.raises(EngineDeadError, match="not running"):
                await collect(engine, "late", [1, 2, 3])
        finally:
            engine.shutdown()

    asyncio.run(main())


def test_the_engine_is_built_and_stepped_on_one_thread_not_the_callers(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """All torch work of a served engine runs on its engine thread (one OpenMP team), and the
    thread ends at shutdown; an engine that never started releases its thread too."""
    import blockserve.engine.async_engine as module
    from blockserve.engine.llm_engine import LLMEngine, build_engine

    threads: dict[str, set[int]] = {"build": set(), "step": set()}

    def recording_build(config):  # type: ignore[no-untyped-def]
        threads["build"].add(threading.get_ident())
        return build_engine(config)

    real_step = LLMEngine.step

    def recording_step(self):  # type: ignore[no-untyped-def]
        threads["step"].add(threading.get_ident())
        return real_step(self)

    monkeypatch.setattr(module, "build_engine", recording_build)
    monkeypatch.setattr(LLMEngine, "step", recording_step)
    engine = make_engine(tiny_llama_dir)

    async def main() -> RequestOutput:
        engine.start()
        try:
            return (await collect(engine, "r", [1, 2, 3]))[-1]
        finally:
            engine.shutdown()

    assert asyncio.run(main()).finished
    assert threads["build"] == threads["step"] == {engine._thread.ident}
    assert engine._thread.ident != threading.get_ident()
    assert not engine._thread.is_alive()

    unstarted = make_engine(tiny_llama_dir)
    unstarted.shutdown()
    assert not unstarted._thread.is_alive()
