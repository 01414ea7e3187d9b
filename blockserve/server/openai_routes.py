"""`/v1/completions` and `/v1/chat/completions`: requests in, engine streams out.

Each prompt becomes one engine request (its `n` samples inside it). Non-streaming handlers
watch for a client disconnect and abort; streaming handlers abort when the response stream is
closed. Validation and refusal errors surface before any byte of a stream is sent.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from blockserve.engine.client import EngineClient
from blockserve.engine.outputs import CompletionOutput, RequestOutput
from blockserve.engine.request import Prompt, RequestSpec
from blockserve.errors import InvalidRequestError, ModelNotFoundError, RequestFailedError
from blockserve.sampling_params import SamplingParams
from blockserve.server.metrics import RequestTimer, ServerMetrics
from blockserve.server.protocol import ChatCompletionRequest, CompletionRequest
from blockserve.server.responses import (
    ChoiceTracker,
    TokenText,
    chat_logprobs,
    completion_logprobs,
    sse,
    usage,
)

DISCONNECT_POLL_S = 0.1


@dataclass(frozen=True)
class ServingContext:
    engine: EngineClient
    model_name: str
    tokenizer: Any  # the event loop's copy: never shared with the engine thread
    metrics: ServerMetrics

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise ModelNotFoundError(f"The model `{model}` does not exist.")


class _Run:
    """One HTTP request's engine requests, merged into one stream of (prompt index, output)."""

    def __init__(self, ctx: ServingContext, request_id: str, prompts: list[Prompt]) -> None:
        self.ctx = ctx
        self.request_id = request_id
        self.prompts = prompts
        self.streams: list[AsyncIterator[RequestOutput]] = []
        self.first: list[RequestOutput] = []
        self.timers = [RequestTimer(ctx.metrics, time.monotonic()) for _ in prompts]

    async def start(self, params: SamplingParams, priority: int, salt: str | None) -> None:
        """Submit every prompt and wait for its first output: refusals raise here."""
        self.streams = [
            self.ctx.engine.generate(
                RequestSpec(f"{self.request_id}-{i}", prompt, params, priority, salt)
            )
            for i, prompt in enumerate(self.prompts)
        ]
        # All prompts are submitted together (so they share steps), then their first outputs.
        firsts = await asyncio.gather(
            *(anext(stream) for stream in self.streams),
            return_exceptions=True,
        )
        errors = [f for f in firsts if isinstance(f, BaseException)]
        if errors:
            await self.close()
            raise errors[0]
        self.first = list(firsts)  # type: ignore[arg-type]

    def _observe(self, index: int, output: RequestOutput) -> None:
        timer = self.timers[index]
        timer.on_output(sum(len(c.token_ids) for c in output.outputs))
        if output.finished:
            timer.on_finish([c.finish_reason or "abort" for c in output.outputs])

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        queue: asyncio.Queue[tuple[int, RequestOutput] | BaseException | None] = asyncio.Queue()

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
        for stream in self.streams:
            await stream.aclose()  # type: ignore[attr-defined]


async def _final_outputs(run: _Run, request: Request) -> list[RequestOutput]:
    """Drive the run to completion; abort everything if the client goes away."""
    finals: dict[int, RequestOutput] = {}

    async def consume() -> None:
        async for index, output in run.outputs():
            finals[index] = output

    task = asyncio.create_task(consume())
    try:
        while not task.done():
            await asyncio.wait([task], timeout=DISCONNECT_POLL_S)
            if not task.done() and await request.is_disconnected():
                task.cancel()
                break
        await task
    finally:
        if not task.done():
            task.cancel()
        await run.close()
    outputs = [finals[i] for i in range(len(run.prompts))]
    errors = [o.error for o in outputs if o.error]
    if errors:
        raise RequestFailedError(errors[0])
    return outputs


def _completion_choice(
    index: int, choice: CompletionOutput, token_text: TokenText, body: CompletionRequest
) -> dict[str, Any]:
    want_logprobs = body.logprobs is not None
    extra = {"token_ids": list(choice.token_ids)} if body.return_token_ids else {}
    return {
        **extra,
        "index": index,
        "text": choice.text,
        "logprobs": completion_logprobs(choice.logprobs or (), token_text, 0)
        if want_logprobs
        else None,
        "finish_reason": choice.finish_reason,
        "stop_reason": choice.stop_reason,
    }


async def create_completion(
    ctx: ServingContext, body: CompletionRequest, request: Request
) -> JSONResponse | StreamingResponse:
    ctx.check_model(body.model)
    if body.echo:
        raise InvalidRequestError("echo is not supported")
    params = body.sampling_params(body.max_tokens, body.logprobs)
    run = _Run(ctx, body.request_id or f"cmpl-{uuid.uuid4().hex}", body.prompts())
    await run.start(params, body.priority, body.cache_salt)
    created = int(time.time())
    token_text = TokenText(ctx.tokenizer)
    want_logprobs = body.logprobs is not None
    n = params.n

    def base(choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": run.request_id,
            "object": "text_completion",
            "created": created,
            "model": ctx.model_name,
            "choices": choices,
        }

    if not body.stream:
        outputs = await _final_outputs(run, request)
        choices = [
            _completion_choice(i * n + c.index, c, token_text, body)
            for i, output in enumerate(outputs)
            for c in output.outputs
        ]
        return JSONResponse({**base(choices), "usage": usage(outputs)})

    def chunk(index: int, choice: CompletionOutput, delta: tuple[str, int, int, bool]) -> dict:
        text, first, end, finished = delta
        logprobs = None
        if want_logprobs and choice.logprobs is not None:
            logprobs = completion_logprobs(choice.logprobs[first:end], token_text, 0)
        extra = {"token_ids": list(choice.token_ids[first:end])} if body.return_token_ids else {}
        return base(
            [
                {
                    "index": index,
                    "text": text,
                    "logprobs": logprobs,
                    **extra,
                    "finish_reason": choice.finish_reason if finished else None,
                    "stop_reason": choice.stop_reason if finished else None,
                }
            ]
        )

    include_usage = body.stream_options is not None and body.stream_options.include_usage
    return _stream(
        run, n, chunk, base if include_usage else None, every_token=body.return_token_ids
    )


def _stream(
    run: _Run,
    n: int,
    make_chunk: Callable[[int, CompletionOutput, tuple[str, int, int, bool]], dict[str, Any]],
    usage_base: Callable[[list[dict[str, Any]]], dict[str, Any]] | None,
    first_chunks: Callable[[int], list[dict[str, Any]]] | None = None,
    every_token: bool = False,
) -> StreamingResponse:
    async def events() -> AsyncIterator[str]:
        tracker = ChoiceTracker(every_token)
        finals: dict[int, RequestOutput] = {}
        try:
            async for prompt_index, output in run.outputs():
                finals[prompt_index] = output
                if output.error:
                    yield sse(
                        {
                            "error": {
                                "message": output.error,
                                "type": "InternalServerError",
                                "param": None,
                                "code": 500,
                            }
                        }
                    )
                    break
                for choice in output.outputs:
                    index = prompt_index * n + choice.index
                    if first_chunks is not None and tracker.take_role(index):
                        for extra in first_chunks(index):
                            yield sse(extra)
                    delta = tracker.delta(index, choice)
                    if delta is not None:
                        yield sse(make_chunk(index, choice, delta))
            if usage_base is not None and len(finals) == len(run.prompts):
                yield sse({**usage_base([]), "usage": usage([finals[i] for i in sorted(finals)])})
            yield sse("[DONE]")
        finally:
            await run.close()  # a closed stream (client gone) aborts what is still running

    return StreamingResponse(events(), media_type="text/event-stream")


def render_chat_prompt(ctx: ServingContext, body: ChatCompletionRequest) -> list[int]:
    messages = [{"role": m.role, "content": m.text()} for m in body.messages]
    try:
        text = ctx.tokenizer.apply_chat_template(
            messages, add_generation_prompt=body.add_generation_prompt, tokenize=False
        )
    except Exception as exc:  # a template error is the request's fault
        raise InvalidRequestError(f"the chat template failed: {exc}") from exc
    return list(ctx.tokenizer.encode(text, add_special_tokens=False))


async def create_chat_completion(
    ctx: ServingContext, body: ChatCompletionRequest, request: Request
) -> JSONResponse | StreamingResponse:
    ctx.check_model(body.model)
    params = body.sampling_params(body.effective_max_tokens(), body.num_logprobs())
    run = _Run(
        ctx,
        body.request_id or f"chatcmpl-{uuid.uuid4().hex}",
        [tuple(render_chat_prompt(ctx, body))],
    )
    await run.start(params, body.priority, body.cache_salt)
    created = int(time.time())
    token_text = TokenText(ctx.tokenizer)

    def base(choices: list[dict[str, Any]], kind: str = "chat.completion.chunk") -> dict[str, Any]:
        return {
            "id": run.request_id,
            "object": kind,
            "created": created,
            "model": ctx.model_name,
            "choices": choices,
        }

    if not body.stream:
        (output,) = await _final_outputs(run, request)
        choices = [
            {
                "index": c.index,
                "message": {"role": "assistant", "content": c.text},
                "logprobs": chat_logprobs(c.logprobs or (), token_text) if body.logprobs else None,
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
            }
            for c in output.outputs
        ]
        return JSONResponse({**base(choices, "chat.completion"), "usage": usage([output])})

    def chunk(index: int, choice: CompletionOutput, delta: tuple[str, int, int, bool]) -> dict:
        text, first, end, finished = delta
        logprobs = None
        if body.logprobs and choice.logprobs is not None:
            logprobs = chat_logprobs(choice.logprobs[first:end], token_text)
        return base(
            [
                {
                    "index": index,
                    "delta": {"content": text} if text else {},
                    "logprobs": logprobs,
                    "finish_reason": choice.finish_reason if finished else None,
                }
            ]
        )

    def role_chunk(index: int) -> list[dict[str, Any]]:
        return [
            base(
                [
                    {
                        "index": index,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                ]
            )
        ]

    include_usage = body.stream_options is not None and body.stream_options.include_usage
    return _stream(run, params.n, chunk, base if include_usage else None, role_chunk)
