"""`AsyncEngine`: an `LLMEngine` on its own thread, with per-request async streams; the
`EngineClient` the HTTP server uses."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import torch

from blockserve.config import EngineConfig
from blockserve.engine.client import ModelInfo
from blockserve.engine.llm_engine import LLMEngine, build_engine
from blockserve.engine.outputs import EngineStats, KVCacheReport, MissRatioReport, RequestOutput
from blockserve.engine.request import RequestSpec, ValidatedRequest
from blockserve.engine.tokenizer_pool import PoolTokenizing, TokenizerPool
from blockserve.errors import EngineDeadError, InvalidRequestError, ModelNotFoundError
from blockserve.lora.names import LoRAError, check_lora_name

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Abort:
    request_id: str


@dataclass(frozen=True)
class _Call:
    fn: Callable[[LLMEngine], Any]
    result: concurrent.futures.Future[Any]


@dataclass(frozen=True)
class _Stop:
    pass


_Command = ValidatedRequest | _Abort | _Call | _Stop


class EngineThread(threading.Thread):
    """The one thread that runs an engine's torch work: callables run in order, as submitted,
    with the torch thread count of the thread that created it."""

    def __init__(self) -> None:
        super().__init__(name="blockserve-engine", daemon=True)
        self._threads = torch.get_num_threads()
        self._work: queue.SimpleQueue[tuple[Callable[[], Any], concurrent.futures.Future[Any]]]
        self._work = queue.SimpleQueue()
        self.start()

    def submit(self, fn: Callable[[], Any]) -> concurrent.futures.Future[Any]:
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._work.put((fn, future))
        return future

    def run(self) -> None:
        torch.set_num_threads(self._threads)
        while True:
            fn, future = self._work.get()
            try:
                future.set_result(fn())
            except BaseException as exc:  # the submitter gets it
                future.set_exception(exc)
            if fn is _finish:
                return


def _finish() -> None:
    """Submitted last: the engine thread ends after it."""


class AsyncEngine(PoolTokenizing):
    """Implements `EngineClient`: generate, abort, tokenize, health, model info, stats, KV
    report.

    Requests are checked and tokenized on a small pool of worker threads
    (engine/tokenizer_pool.py), off the event loop and off the engine thread, so a refusal costs
    the engine nothing and a long prompt costs only its own latency. One background thread owns
    the engine: it applies queued adds and aborts between steps, steps while there is work, and
    leaves a stats snapshot after each step, so the engine is never touched concurrently.
    Outputs travel to the loop thread-safely. A request whose stream is closed early (client
    gone) is aborted. An error that escapes a step marks the engine dead: every stream fails
    (with the error's type only: its text may quote a request), health turns false.

    `from_config` builds the engine on the thread that will step it, so that one thread runs all
    of the engine's torch work. torch's CPU ops fan out over an OpenMP team per calling thread;
    a second, idle team (left by loading the model on another thread) puts the process over its
    core count, and OpenMP then lets the stepping team's workers sleep between ops instead of
    spinning (docs/benchmarks/vs-vllm.md measured the cost).
    """

    def __init__(
        self, engine: LLMEngine, tokenizer_workers: int = 2, thread: EngineThread | None = None
    ) -> None:
        self.engine = engine
        processor = engine.input_processor
        self._tokenizers = TokenizerPool(processor, tokenizer_workers)
        self._model_info = ModelInfo(
            name=engine.core.info.model_name,
            max_model_len=processor.max_model_len,
            vocab_size=processor.vocab_size,
            tokenizer=processor.tokenizer,
            default_sampling=engine.default_sampling,
            runtime=engine.core.info.runtime,
            lora_adapters=lora.registry if (lora := engine.core.lora) else {},
        )
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._streams: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}
        self._stats = engine.stats()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = thread or EngineThread()
        self._stopping = threading.Event()
        self.dead_error: BaseException | None = None

    @classmethod
    def from_config(cls, config: EngineConfig, tokenizer_workers: int = 2) -> AsyncEngine:
        """Build the engine on its engine thread (see the module's docstring)."""
        thread = EngineThread()
        try:
            engine = thread.submit(lambda: build_engine(config)).result()
        except BaseException:
            thread.submit(_finish)
            raise
        return cls(engine, tokenizer_workers, thread)

    def start(self) -> None:
        """Start stepping on the engine thread; outputs go to the running event loop."""
        self._loop = asyncio.get_running_loop()
        self._thread.submit(self._run)
        self._thread.submit(_finish)

    def is_healthy(self) -> bool:
        return self.dead_error is None and self._loop is not None and self._thread.is_alive()

    def model_info(self) -> ModelInfo:
        return self._model_info

    def stats(self) -> EngineStats:
        """The snapshot the engine thread took after its last step."""
        return self._stats

    async def load_lora(self, name: str, path: str) -> None:
        """Read and check the adapter on a worker thread (the steps go on), then serve it
        from the next step; LoRAError (nothing changed) when it cannot be served."""
        manager = self.engine.lora_manager()
        try:
            check_lora_name(name)
        except LoRAError as exc:
            raise InvalidRequestError(str(exc), "lora_name") from None
        if name in manager.registry:
            raise InvalidRequestError(
                f"The lora adapter '{name}' has already been loaded.", "lora_name"
            )
        try:
            adapter = await asyncio.to_thread(manager.read, name, path)
        except LoRAError as exc:
            raise InvalidRequestError(str(exc), "lora_path") from None
        await self._call(lambda engine: engine.lora_manager().add(adapter))

    async def unload_lora(self, name: str) -> None:
        await self._call(lambda engine: engine.remove_lora(name))

    async def debug_kv_cache(self) -> KVCacheReport:
        report: KVCacheReport = await self._call(LLMEngine.kv_cache_report)
        return report

    async def debug_miss_ratio_curve(self) -> MissRatioReport:
        report: MissRatioReport = await self._call(LLMEngine.miss_ratio_report)
        return report

    async def generate(self, spec: RequestSpec) -> AsyncIterator[RequestOutput]:
        """Yield a snapshot of the request after every step that changed it, last one finished.

        Raises InvalidRequestError (before any output) if the spec is refused. Closing the
        iterator early aborts the request.
        """
        self._check_alive()
        self.engine.input_processor.check_request_id(spec.request_id, self._streams)
        stream: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        # Registered at once: it holds the id while the prompt is tokenized, and no output can
        # arrive before its stream.
        self._streams[spec.request_id] = stream
        finished = False
        try:
            request = await self._tokenizers.run(lambda p: p.process(spec, ()))
            self._commands.put(request)
            while not finished:
                item = await stream.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            self._streams.pop(spec.request_id, None)
            if not finished:
                self.abort(spec.request_id)

    def abort(self, request_id: str) -> None:
        """Abort a request; its blocks are freed before the engine's next step."""
        self._commands.put(_Abort(request_id))

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine thread (in-flight requests are aborted) and release resources."""
        self._tokenizers.shutdown()
        self._stopping.set()
        self._commands.put(_Stop())
        if self._loop is None:  # never started: the thread only waits for work
            self._thread.submit(_finish)
        self._thread.join(timeout)
        self.engine.shutdown()

    def _check_alive(self) -> None:
        if not self.is_healthy():
            raise EngineDeadError("the engine is not running") from self.dead_error

    async def _call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """Run `fn(engine)` on the engine thread between two steps and return its result."""
        self._check_alive()
        result: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._commands.put(_Call(fn, result))
        return await asyncio.wrap_future(result)

    # -- the engine thread ----------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stopping.is_set():
                self._apply_commands(block=not self.engine.has_unfinished_requests())
                if self._stopping.is_set():
                    break
                if self.engine.has_unfinished_requests():
                    self._deliver(self.engine.step())
                self._stats = self.engine.stats()
        except BaseException as exc:  # the loop cannot go on: fail everyone, loudly
            logger.exception("engine loop died")
            self.dead_error = exc
            message = f"the engine loop died ({type(exc).__name__}); the server log has details"
            self._fail_all(EngineDeadError(message))
            return
        self.engine.abort_all()
        self._fail_all(EngineDeadError("the engine is shutting down"))

    def _apply_commands(self, block: bool) -> None:
        try:
            command = self._commands.get(timeout=0.5) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            if isinstance(command, _Stop):
                self._stopping.set()
                return
            self._apply(command)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return

    def _apply(self, command: _Command) -> None:
        if isinstance(command, ValidatedRequest):
            try:
                self.engine.add_validated(command)
            except ModelNotFoundError as exc:  # its adapter went since it was checked
                self._fail_one(command.request_id, exc)
        elif isinstance(command, _Abort):
            self.engine.abort_request([command.request_id])
        elif isinstance(command, _Call):
            try:
                command.result.set_result(command.fn(self.engine))
            except Exception as exc:  # the caller gets it; the engine is unaffected
                command.result.set_exception(exc)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        if outputs and self._loop is not None:
            self._loop.call_soon_threadsafe(self._dispatch, outputs)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is not None:
                stream.put_nowait(output)

    def _fail_one(self, request_id: str, error: BaseException) -> None:
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._put_error, request_id, error)

    def _put_error(self, request_id: str, error: BaseException) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.put_nowait(error)

    def _fail_all(self, error: BaseException) -> None:
        if self._loop is None or self._loop.is_closed():
            return

        def fail() -> None:
            for stream in self._streams.values():
                stream.put_nowait(error)

        self._loop.call_soon_threadsafe(fail)
