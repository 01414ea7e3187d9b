"""`AsyncEngine`: an `LLMEngine` on its own thread, with per-request async streams.

One background thread owns the engine: it applies queued adds and aborts between steps and
steps while there is work, so the engine is never touched concurrently. Outputs travel to the
asyncio loop thread-safely. A request whose stream is closed early (client gone) is aborted.
An error that escapes a step marks the engine dead: every stream fails, health turns false.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from blockserve.engine.llm_engine import EngineStats, LLMEngine, Prompt
from blockserve.engine.outputs import RequestOutput
from blockserve.errors import EngineDeadError, InvalidRequestError
from blockserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Add:
    request_id: str
    prompt: Prompt
    params: SamplingParams
    priority: int
    cache_salt: str | None
    accepted: concurrent.futures.Future[None]


@dataclass(frozen=True)
class _Abort:
    request_id: str


@dataclass(frozen=True)
class _Call:
    fn: Callable[[LLMEngine], Any]
    result: concurrent.futures.Future[Any]


_STOP = object()


class AsyncEngine:
    """The `EngineClient` the HTTP server uses: generate, abort, health, stats."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._commands: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._streams: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self.dead_error: BaseException | None = None

    @property
    def model_name(self) -> str:
        return self.engine.model_name

    def start(self) -> None:
        """Start the engine thread; outputs are delivered to the running event loop."""
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="blockserve-engine", daemon=True)
        self._thread.start()

    def is_healthy(self) -> bool:
        return self.dead_error is None and self._thread is not None and self._thread.is_alive()

    def stats(self) -> EngineStats:
        return self.engine.get_stats()

    async def generate(
        self,
        prompt: Prompt,
        params: SamplingParams,
        request_id: str,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yield a snapshot of the request after every step that changed it, last one finished.

        Raises the engine's typed error (e.g. InvalidRequestError) if the request is refused.
        Closing the iterator early aborts the request.
        """
        if not self.is_healthy():
            raise EngineDeadError("the engine is not running") from self.dead_error
        if request_id in self._streams:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        stream: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        # Registered before the add is sent, so no output can arrive before its stream.
        self._streams[request_id] = stream
        accepted: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._commands.put(_Add(request_id, prompt, params, priority, cache_salt, accepted))
        try:
            await asyncio.wrap_future(accepted)  # validation errors raise here
        except BaseException:
            self._streams.pop(request_id, None)
            self.abort(request_id)  # cancelled while being added: a no-op if it was refused
            raise
        finished = False
        try:
            while True:
                item = await stream.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    async def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """Run `fn(engine)` on the engine thread between two steps and return its result."""
        if not self.is_healthy():
            raise EngineDeadError("the engine is not running") from self.dead_error
        result: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._commands.put(_Call(fn, result))
        return await asyncio.wrap_future(result)

    def abort(self, request_id: str) -> None:
        """Abort a request; its blocks are freed before the engine's next step."""
        self._commands.put(_Abort(request_id))

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine thread (in-flight requests are aborted) and release resources."""
        self._stopping.set()
        self._commands.put(_STOP)
        if self._thread is not None:
            self._thread.join(timeout)
        self.engine.shutdown()

    # -- the engine thread ----------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stopping.is_set():
                self._apply_commands(block=not self.engine.has_unfinished_requests())
                if self._stopping.is_set():
                    break
                if self.engine.has_unfinished_requests():
                    self._deliver(self.engine.step())
        except BaseException as exc:  # the loop cannot go on: fail everyone, loudly
            logger.exception("engine loop died")
            self.dead_error = exc
            self._fail_all(EngineDeadError(f"the engine loop died: {exc}"))
            return
        self.engine.abort_all()
        self._fail_all(EngineDeadError("the engine is shutting down"))

    def _apply_commands(self, block: bool) -> None:
        try:
            command = self._commands.get(timeout=0.5) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            if command is _STOP:
                self._stopping.set()
                return
            if isinstance(command, _Add):
                try:
                    self.engine.add_request(
                        command.request_id,
                        command.prompt,
                        command.params,
                        command.priority,
                        command.cache_salt,
                    )
                except Exception as exc:  # refused: the caller gets the typed error
                    command.accepted.set_exception(exc)
                else:
                    command.accepted.set_result(None)
            elif isinstance(command, _Abort):
                self.engine.abort_request([command.request_id])
            elif isinstance(command, _Call):
                try:
                    command.result.set_result(command.fn(self.engine))
                except Exception as exc:  # the caller gets it; the engine is unaffected
                    command.result.set_exception(exc)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        if outputs and self._loop is not None:
            self._loop.call_soon_threadsafe(self._dispatch, outputs)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is not None:
                stream.put_nowait(output)

    def _fail_all(self, error: BaseException) -> None:
        if self._loop is None or self._loop.is_closed():
            return

        def fail() -> None:
            for stream in self._streams.values():
                stream.put_nowait(error)

        self._loop.call_soon_threadsafe(fail)
