"""`/v1/chat/completions` (completions.py has `/v1/completions`): requests in, engine streams
out. Non-streaming handlers watch for a client disconnect and abort; streaming handlers abort
when the response stream is closed. Validation and refusal errors surface before any byte of a
stream is sent."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from blockserve.engine.outputs import CompletionOutput, RequestOutput
from blockserve.multimodal.inputs import ImageInput
from blockserve.server.context import ServingContext
from blockserve.server.http_run import HttpRun, final_outputs, stream_response
from blockserve.server.protocol import ChatCompletionRequest
from blockserve.server.responses import TokenText, chat_logprobs, prompt_logprobs_json, usage
from blockserve.server.tools import (
    ToolCallStream,
    ToolPlan,
    finish_reason,
    plan_tools,
    reply_message,
)


async def chat_prompt(
    ctx: ServingContext, body: ChatCompletionRequest, tools: tuple[dict[str, Any], ...] = ()
) -> tuple[tuple[int, ...], tuple[ImageInput, ...]]:
    """The conversation's prompt token ids, rendered and tokenized off the event loop, and
    its images (`image_url` parts), decoded and placed there."""
    if any(m.has_images() for m in body.messages):
        messages = [{"role": m.role, "content": m.parts()} for m in body.messages]
        return await ctx.engine.tokenize_image_chat(
            messages, body.add_generation_prompt, ctx.trust_chat_special_tokens, tools
        )
    text = [{"role": m.role, "content": m.text()} for m in body.messages]
    ids = await ctx.engine.tokenize_chat(
        text, body.add_generation_prompt, ctx.trust_chat_special_tokens, tools
    )
    return ids, ()


def _chat_choice(
    choice: CompletionOutput, token_text: TokenText, want_logprobs: bool, plan: ToolPlan, role: str
) -> dict:
    logprobs = chat_logprobs(choice.logprobs or (), token_text) if want_logprobs else None
    message, called = reply_message(plan, choice.text, role, choice.finish_reason)
    return {
        "index": choice.index,
        "message": message,
        "logprobs": logprobs,
        "finish_reason": finish_reason(plan, choice.finish_reason, called),
        "stop_reason": choice.stop_reason,
    }


def _chat_response(base: dict[str, Any], output: RequestOutput, token_text: TokenText) -> dict:
    return {
        **base,
        "usage": usage([output]),
        "prompt_logprobs": prompt_logprobs_json(output.prompt_logprobs, token_text),
    }


def _chat_delta(
    index: int, delta: dict[str, str], logprobs: dict | None = None, finish: str | None = None
) -> dict[str, Any]:
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}


async def create_chat_completion(
    ctx: ServingContext, body: ChatCompletionRequest, request: Request
) -> JSONResponse | StreamingResponse:
    lora_name = ctx.check_model(body.model)
    num_logprobs = body.num_logprobs()
    plan = plan_tools(body, ctx.tool_call_parser)
    prompt, images = await chat_prompt(ctx, body, plan.tools)
    room = ctx.engine.model_info().max_model_len - len(prompt)
    default = max(1, min(ctx.default_chat_max_tokens, room))  # the server's, within the room
    constraint = plan.constraint or body.constraint()
    params = body.sampling_params(default, num_logprobs, constraint, ctx.default_sampling)
    ctx.check_limits(params, [prompt])
    run = HttpRun(
        ctx=ctx,
        request_id=body.request_id or f"chatcmpl-{uuid.uuid4().hex}",
        prompts=[prompt],
        images=[images],
    )
    salt = ctx.cache_salt(request, body.cache_salt)
    await run.start(params, body.priority, salt, request, body.return_cache_explanation, lora_name)
    created = int(time.time())
    token_text = TokenText(ctx.tokenizer)
    role = ctx.response_role if body.add_generation_prompt else body.messages[-1].role

    def base(choices: list[dict[str, Any]], kind: str = "chat.completion.chunk") -> dict[str, Any]:
        return {
            "id": run.request_id,
            "object": kind,
            "created": created,
            "model": lora_name or ctx.model_name,
            "choices": choices,
        }

    if not body.stream:
        (output,) = await final_outputs(run, request)

        def respond() -> JSONResponse:
            choices = [
                _chat_choice(c, token_text, body.logprobs, plan, role) for c in output.outputs
            ]
            return JSONResponse(
                _chat_response(base(choices, "chat.completion"), output, token_text)
            )

        return await asyncio.to_thread(respond)  # off the event loop, as completions' bodies

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
