"""`/v1/completions` and `/v1/chat/completions`: requests in, engine streams out. Each prompt
becomes one engine request (its `n` samples inside it). Non-streaming handlers watch for a client
disconnect and abort; streaming handlers abort when the response stream is closed. Validation and
refusal errors surface before any byte of a stream is sent."""

from __future__ import annotations

import time
import uuid
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from blockserve.engine.outputs import CompletionOutput
from blockserve.errors import InvalidRequestError
from blockserve.server.http_run import HttpRun, ServingContext, final_outputs, stream_response
from blockserve.server.protocol import ChatCompletionRequest, CompletionRequest
from blockserve.server.responses import TokenText, chat_logprobs, completion_logprobs, usage
from blockserve.server.tools import (
    ToolCallStream,
    ToolPlan,
    finish_reason,
    plan_tools,
    reply_message,
)


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
    # No default: a completion's max_tokens is 16 unless the body sets it (null: no limit).
    params = body.sampling_params(None, body.logprobs, body.constraint(), ctx.default_sampling)
    prompts = body.prompts()
    ctx.check_limits(params, len(prompts))
    run = HttpRun(ctx, body.request_id or f"cmpl-{uuid.uuid4().hex}", prompts)
    salt = ctx.cache_salt(request, body.cache_salt)
    await run.start(params, body.priority, salt, request, body.return_cache_explanation)
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
        outputs = await final_outputs(run, request)
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
    return stream_response(
        run, n, chunk, base if include_usage else None, every_token=body.return_token_ids
    )


async def chat_prompt(
    ctx: ServingContext, body: ChatCompletionRequest, tools: tuple[dict[str, Any], ...] = ()
) -> tuple[int, ...]:
    """The conversation's prompt token ids, rendered and tokenized off the event loop."""
    messages = [{"role": m.role, "content": m.text()} for m in body.messages]
    return await ctx.engine.tokenize_chat(
        messages, body.add_generation_prompt, ctx.trust_chat_special_tokens, tools
    )


def _chat_choice(
    choice: CompletionOutput, token_text: TokenText, want_logprobs: bool, plan: ToolPlan, role: str
) -> dict:
    logprobs = chat_logprobs(choice.logprobs or (), token_text) if want_logprobs else None
    message, called = reply_message(plan, choice.text, role)
    return {
        "index": choice.index,
        "message": message,
        "logprobs": logprobs,
        "finish_reason": finish_reason(plan, choice.finish_reason, called),
        "stop_reason": choice.stop_reason,
    }


def _chat_delta(
    index: int, delta: dict[str, str], logprobs: dict | None = None, finish: str | None = None
) -> dict[str, Any]:
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}


async def create_chat_completion(
    ctx: ServingContext, body: ChatCompletionRequest, request: Request
) -> JSONResponse | StreamingResponse:
    ctx.check_model(body.model)
    num_logprobs = body.num_logprobs()
    plan = plan_tools(body, ctx.tool_call_parser)
    prompt = await chat_prompt(ctx, body, plan.tools)
    room = ctx.engine.model_info().max_model_len - len(prompt)
    default = max(1, min(ctx.default_chat_max_tokens, room))  # the server's, within the room
    constraint = plan.constraint or body.constraint()
    params = body.sampling_params(default, num_logprobs, constraint, ctx.default_sampling)
    ctx.check_limits(params, 1)
    run = HttpRun(ctx, body.request_id or f"chatcmpl-{uuid.uuid4().hex}", [prompt])
    salt = ctx.cache_salt(request, body.cache_salt)
    await run.start(params, body.priority, salt, request, body.return_cache_explanation)
    created = int(time.time())
    token_text = TokenText(ctx.tokenizer)
    role = ctx.response_role if body.add_generation_prompt else body.messages[-1].role

    def base(choices: list[dict[str, Any]], kind: str = "chat.completion.chunk") -> dict[str, Any]:
        return {
            "id": run.request_id,
            "object": kind,
            "created": created,
            "model": ctx.model_name,
            "choices": choices,
        }

    if not body.stream:
        (output,) = await final_outputs(run, request)
        choices = [_chat_choice(c, token_text, body.logprobs, plan, role) for c in output.outputs]
        return JSONResponse({**base(choices, "chat.completion"), "usage": usage([output])})

    streams: dict[int, ToolCallStream] = {}

    def chunk(
        index: int, choice: CompletionOutput, delta: tuple[str, int, int, bool]
    ) -> dict | None:
        text, first, end, finished = delta
        logprobs = None
        if body.logprobs and choice.logprobs is not None:
            logprobs = chat_logprobs(choice.logprobs[first:end], token_text)
        if plan.mode == "none":
            finish = choice.finish_reason if finished else None
            return base([_chat_delta(index, {"content": text} if text else {}, logprobs, finish)])
        stream = streams.setdefault(index, ToolCallStream(plan))
        message = stream.delta(text, finished)
        if not message and not finished and logprobs is None:
            return None  # a call still incomplete: nothing to send yet
        finish = finish_reason(plan, choice.finish_reason, stream.called) if finished else None
        return base([_chat_delta(index, message, logprobs, finish)])

    def role_chunk(index: int) -> list[dict[str, Any]]:
        return [base([_chat_delta(index, {"role": role, "content": ""})])]

    include_usage = body.stream_options is not None and body.stream_options.include_usage
    return stream_response(run, params.n, chunk, base if include_usage else None, role_chunk)
