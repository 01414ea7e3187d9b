"""One HTTP request's engine requests, driven as one: submitted together, merged into one
stream of outputs, aborted together when the client leaves, and rendered as SSE."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import StreamingResponse
from starlette.types import Message, Send

from blockserve.engine.outputs import CompletionOutput, RequestOutput
from blockserve.engine.request import RequestSpec, TextPrompt
from blockserve.errors import (
    ClientDisconnectedError,
    EngineDeadError,
    RequestFailedError,
    ServerShuttingDownError,
)
from blockserve.multimodal.inputs import ImageInput
from blockserve.sampling_params import SamplingParams
from blockserve.server.context import ServingContext
from blockserve.server.drain import Drain
from blockserve.server.errors import error_body
from blockserve.server.metrics import RequestTimer
from blockserve.server.responses import ChoiceTracker, sse, usage

DISCONNECT_POLL_S = 0.1
T = TypeVar("T")
logger = logging.getLogger("blockserve.server")


def shutting_down() -> ServerShuttingDownError:
    return ServerShuttingDownError(
        "the server is shutting down, and this request did not finish before its drain deadline"
    )


class HttpRun:
    """One HTTP request's engine requests, merged into one stream of (prompt index, output).

    `request_id` is the response's `id`: the client's label if it gave one, echoed and never
    used as a key. The engine knows the run by ids made here, unique to it, so two clients
    with one label get their own outputs, and no answer says whether a label is in use.

    `HttpRun` fans a request's prompts out to the engine client and back in; `final_outputs`
    drives it to the end for a JSON answer (watching for a disconnect); `stream_response` turns
    it into an event stream whose closing aborts what still runs.
    """

    def __init__(
        self,
        ctx: ServingContext,
        request_id: str,
        prompts: list[TextPrompt],
        images: list[tuple[ImageInput, ...]] | None = None,  # each token-id prompt's, if any
    ) -> None:
        self.ctx = ctx
        self.request_id = request_id
        self._engine_id = f"run-{uuid.uuid4().hex}"
        self.prompts = prompts
        self.images = images or [() for _ in prompts]
        self.streams: list[AsyncIterator[RequestOutput]] = []
        self.first: list[RequestOutput] = []
        self.timers = [RequestTimer(ctx.metrics, time.monotonic()) for _ in prompts]
        self.num_choices = 1  # per prompt (the request's n), set by start()
        self._refused = False  # the engine refused a prompt: nothing ran, nothing to abort
        self._queue: asyncio.Queue[tuple[int, RequestOutput] | BaseException | None] | None = None
        self._closed = False

    def expire(self) -> None:
        """The drain deadline passed: the outputs (or the wait for the first) end with
        ServerShuttingDownError."""
        if self._queue is not None:
            self._queue.put_nowait(shutting_down())

    async def start(
        self,
        params: SamplingParams,
        priority: int,
        salt: str | None,
        request: Request,
        explain_cache: bool = False,
        lora_name: str | None = None,
    ) -> None:
        """Submit every prompt and wait for its first output: refusals raise here. A client
        that leaves while its prompts wait in the queue aborts them before they are scheduled
        (ClientDisconnectedError ends the handler)."""
        self.ctx.drain.run_started(self)
        self.num_choices = params.n
        self.streams = [
            self.ctx.engine.generate(
                RequestSpec(
                    f"{self._engine_id}-{i}",
                    prompt,
                    params,
                    priority=priority,
                    cache_salt=salt,
                    explain_cache=explain_cache,
                    lora_name=lora_name,
                    group_id=self._engine_id,  # its prompts share one fair share of the slots
                    images=images,
                )
            )
            for i, (prompt, images) in enumerate(zip(self.prompts, self.images, strict=True))
        ]
        # All prompts are submitted together (so they share steps), then their first outputs.
        gathering = asyncio.gather(
            *(anext(stream) for stream in self.streams),
            return_exceptions=True,
        )
        try:
            firsts = await until_disconnected(
                asyncio.ensure_future(gathering), request, self.ctx.drain
            )
        except BaseException:  # a client gone, or the drain deadline
            await self.close()
            raise
        errors = [f for f in firsts if isinstance(f, BaseException)]
        if errors:
            self._refused = True
            await self.close()
            raise errors[0]
        self.first = list(firsts)  # type: ignore[arg-type]

    def _observe(self, index: int, output: RequestOutput) -> None:
        timer = self.timers[index]
        timer.on_output(sum(len(c.token_ids) for c in output.outputs))
        if output.finished:
            timer.on_finish([c.finish_reason or "abort" for c in output.outputs])

    async def outputs(self) -> AsyncGenerator[tuple[int, RequestOutput], None]:
        queue: asyncio.Queue[tuple[int, RequestOutput] | BaseException | None] = asyncio.Queue()
        self._queue = queue
        if self.ctx.drain.expired.is_set():
            queue.put_nowait(shutting_down())

        async def pump(index: int, stream: AsyncIterator[RequestOutput]) -> None:
            try:
                async for output in stream:
                    await queue.put((index, output))
            except BaseException as exc:  # forwarded to the consumer below
                await queue.put(exc)
            finally:
                await queue.put(None)

        for index, output in enumerate(self.first):
            self._observe(index, output)
            yield index, output
        pending = [i for i, output in enumerate(self.first) if not output.finished]
        tasks = [asyncio.create_task(pump(i, self.streams[i])) for i in pending]
        try:
            remaining = len(tasks)
            while remaining:
                item = await queue.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    self._observe(*item)
                    yield item
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def close(self) -> None:
        """Close every stream (aborting what still runs); only the first call acts."""
        if self._closed:
            return
        self._closed = True
        self.ctx.drain.run_ended(self)
        if not self._refused:
            for timer in self.timers:
                if not timer.finished:
                    timer.on_abort(self.num_choices)
        for stream in self.streams:
            await stream.aclose()  # type: ignore[attr-defined]


async def until_disconnected(task: asyncio.Future[T], request: Request, drain: Drain) -> T:
    """`task`'s result; if the client goes away first, `task` is cancelled and
    ClientDisconnectedError raised; if the drain deadline passes first,
    ServerShuttingDownError."""
    try:
        while not task.done():
            await asyncio.wait([task], timeout=DISCONNECT_POLL_S)
            if task.done():
                break
            if drain.expired.is_set():
                raise shutting_down()
            if await request.is_disconnected():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)  # let it unwind first
                raise ClientDisconnectedError("the client closed the connection")
        return await task
    finally:
        if not task.done():
            task.cancel()


async def final_outputs(run: HttpRun, request: Request) -> list[RequestOutput]:
    """Drive the run to completion; abort everything if the client goes away."""
    finals: dict[int, RequestOutput] = {}

    async def consume() -> None:
        async for index, output in run.outputs():
            finals[index] = output

    try:
        await until_disconnected(asyncio.create_task(consume()), request, run.ctx.drain)
    finally:
        await run.close()
    outputs = [finals[i] for i in range(len(run.prompts))]
    errors = [o.error for o in outputs if o.error]
    if errors:
        raise RequestFailedError(errors[0])
    return outputs


def stream_response(
    run: HttpRun,
    n: int,
    make_chunk: Callable[
        [int, CompletionOutput, tuple[str, int, int, bool]], dict[str, Any] | None
    ],
    usage_base: Callable[[list[dict[str, Any]]], dict[str, Any]] | None,
    first_chunks: Callable[[int], list[dict[str, Any]]] | None = None,
    every_token: bool = False,
) -> StreamingResponse:
    async def events() -> AsyncIterator[str]:
        tracker = ChoiceTracker(every_token)
        finals: dict[int, RequestOutput] = {}
        outputs = run.outputs()
        try:
            try:
                async for prompt_index, output in outputs:
                    finals[prompt_index] = output
                    if output.error:
                        yield sse(error_body(500, output.error))
                        break
                    for choice in output.outputs:
                        index = prompt_index * n + choice.index
                        if first_chunks is not None and tracker.take_role(index):
                            for extra in first_chunks(index):
                                yield sse(extra)
                        delta = tracker.delta(index, choice)
                        chunk = None if delta is None else make_chunk(index, choice, delta)
                        if chunk is not None:  # None: nothing to send for this delta yet
                            yield sse(chunk)
                if usage_base is not None and len(finals) == len(run.prompts):
                    totals = usage([finals[i] for i in sorted(finals)])
                    yield sse({**usage_base([]), "usage": totals})
            except (ServerShuttingDownError, EngineDeadError) as exc:
                # Mid-stream: the drain deadline passed, or the engine (a replica) died. The
                # status line is sent already; the error goes in the stream, which then ends.
                yield sse(error_body(exc.http_status, str(exc)))
            yield sse("[DONE]")
        finally:
            await outputs.aclose()  # its readers of the engine's streams stop first
            await run.close()  # a closed stream (client gone) aborts what is still running

    return StalledReaderBound(events(), run.ctx.stream_write_timeout_s, run.request_id)


class StalledReaderBound(StreamingResponse):
    """An event stream whose every write must go out within `write_timeout_s`: a client that
    stops reading fills the socket's buffers, and the write then waits. Past the timeout the
    stream is closed (its `finally` aborts the request, freeing its blocks) and the app
    returns with the response unfinished, which makes the server close the connection."""

    def __init__(self, events: AsyncIterator[str], write_timeout_s: float, label: str) -> None:
        super().__init__(events, media_type="text/event-stream")
        self.write_timeout_s, self.label = write_timeout_s, label

    async def stream_response(self, send: Send) -> None:
        async def bounded(message: Message) -> None:
            try:
                await asyncio.wait_for(send(message), self.write_timeout_s)
            except TimeoutError:
                raise _Stalled from None

        try:
            await super().stream_response(bounded)
        except _Stalled:
            logger.warning(
                "request %s: its client read nothing for %g s (--stream-write-timeout); aborted",
                self.label,
                self.write_timeout_s,
            )
            await self.body_iterator.aclose()  # type: ignore[attr-defined]


class _Stalled(Exception):
    """A write to the client did not go out in time."""
