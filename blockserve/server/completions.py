"""`/v1/completions`: each prompt one engine request (its `n` samples inside it), answered as
JSON or streamed; `echo` puts the prompt (and with `logprobs` its prompt logprobs) before each
choice, `max_tokens` 0 with `echo` returns the prompt alone (scoring), as vLLM does."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Sequence
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from blockserve.engine.outputs import CompletionOutput, Logprob, RequestOutput
from blockserve.errors import InvalidRequestError
from blockserve.server.context import ServingContext
from blockserve.server.http_run import HttpRun, final_outputs, stream_response
from blockserve.server.protocol import CompletionRequest
from blockserve.server.responses import (
    TokenText,
    completion_logprobs,
    prompt_logprobs_json,
    usage,
)


def _choice(
    index: int,
    output: RequestOutput,
    choice: CompletionOutput,
    token_text: TokenText,
    body: CompletionRequest,
    prompt_json: list[dict[str, dict[str, Any]] | None] | None,
) -> dict[str, Any]:
    """One choice; with `echo`, the prompt's text, ids and logprobs lead its own.
    `prompt_json`: the output's vLLM `prompt_logprobs`, built once for its choices."""
    text, ids = choice.text, list(choice.token_ids)
    logprobs: list[Logprob | None] = list(choice.logprobs or ())
    if body.echo:
        prompt_text = output.prompt
        if prompt_text is None:
            prompt_text = token_text.decode(output.prompt_token_ids)
        scoring = body.max_tokens == 0
        text = prompt_text + ("" if scoring else text)
        ids = [*output.prompt_token_ids, *([] if scoring else ids)]
        logprobs = [*(output.prompt_logprobs or ()), *([] if scoring else logprobs)]
    extra = {"token_ids": list(choice.token_ids)} if body.return_token_ids else {}
    want_logprobs = body.logprobs is not None
    return {
        **extra,
        "index": index,
        "text": text,
        "logprobs": completion_logprobs(logprobs, token_text, 0, ids) if want_logprobs else None,
        "finish_reason": choice.finish_reason,
        "stop_reason": choice.stop_reason,
        "prompt_logprobs": prompt_json,
    }


def _checked(body: CompletionRequest) -> CompletionRequest:
    """The body as the engine runs it: `max_tokens` 0 only with `echo` (one token is run and
    not shown); `echo` with `logprobs` only without streaming (the prompt's logprobs come
    whole, at the end of the prefill)."""
    if body.max_tokens == 0 and not body.echo:
        raise InvalidRequestError("max_tokens must be at least 1 (0 only with echo)", "max_tokens")
    if body.echo and body.logprobs is not None and body.stream:
        raise InvalidRequestError("echo with logprobs is not available when streaming", "echo")
    return body


async def create_completion(
    ctx: ServingContext, body: CompletionRequest, request: Request
) -> JSONResponse | StreamingResponse:
    lora_name = ctx.check_model(body.model)
    _checked(body)
    # No default: a completion's max_tokens is 16 unless the body sets it (null: no limit).
    echoed_logprobs = body.logprobs if body.echo else None
    run_body = body.model_copy(update={"max_tokens": 1}) if body.max_tokens == 0 else body
    params = run_body.sampling_params(
        None, body.logprobs, body.constraint(), ctx.default_sampling, echoed_logprobs
    )
    prompts = body.prompts()
    ctx.check_limits(params, prompts)
    run = HttpRun(ctx, body.request_id or f"cmpl-{uuid.uuid4().hex}", prompts)
    salt = ctx.cache_salt(request, body.cache_salt)
    await run.start(params, body.priority, salt, request, body.return_cache_explanation, lora_name)
    created, token_text, n = int(time.time()), TokenText(ctx.tokenizer), params.n

    def base(choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": run.request_id,
            "object": "text_completion",
            "created": created,
            "model": lora_name or ctx.model_name,
            "choices": choices,
        }

    if not body.stream:
        outputs = await final_outputs(run, request)

        def respond() -> JSONResponse:
            choices = [
                _choice(i * n + c.index, output, c, token_text, body, prompt_json)
                for i, output in enumerate(outputs)
                for prompt_json in [prompt_logprobs_json(output.prompt_logprobs, token_text)]
                for c in output.outputs
            ]
            return JSONResponse({**base(choices), "usage": usage(outputs)})

        # Off the event loop: a scored prompt's body (n choices x its tokens x their top
        # logprobs) takes a while to build, and the streams of others go on meanwhile.
        return await asyncio.to_thread(respond)
    chunk = _stream_chunk(body, base, token_text, _echo_texts(prompts, token_text, n, body))
    include_usage = body.stream_options is not None and body.stream_options.include_usage
    return stream_response(
        run, n, chunk, base if include_usage else None, every_token=body.return_token_ids
    )


def _echo_texts(
    prompts: Sequence[str | tuple[int, ...]], token_text: TokenText, n: int, body: CompletionRequest
) -> list[str]:
    """Per choice index, the text a stream's first chunk starts with: its prompt with echo."""
    if not body.echo:
        return [""] * (len(prompts) * n)
    texts = [p if isinstance(p, str) else token_text.decode(p) for p in prompts]
    return [text for text in texts for _ in range(n)]


def _stream_chunk(
    body: CompletionRequest, base: Any, token_text: TokenText, echo: list[str]
) -> Any:
    want_logprobs, scoring = body.logprobs is not None, body.max_tokens == 0

    def chunk(index: int, choice: CompletionOutput, delta: tuple[str, int, int, bool]) -> dict:
        text, first, end, finished = delta
        text = ("" if scoring else text) if first else echo[index] + ("" if scoring else text)
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

    return chunk
