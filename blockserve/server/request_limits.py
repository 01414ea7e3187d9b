"""What one HTTP request may ask of the engine, checked before anything is queued: prompts per
request, stop strings (their count and total length), and tokens in all: generated ones
(prompts × n × max_tokens) and, with prompt logprobs, the prompts' tokens × n. Each exceeded
bound is a 400 naming the field and its flag."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from blockserve.errors import InvalidRequestError
from blockserve.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """The bounds (`blockserve serve` flags of the same names); defaults in ServerConfig."""

    max_prompts_per_request: int = 2048  # OpenAI's bound on a completions prompt list
    max_stop_strings: int = 64
    max_stop_chars: int = 4096
    max_request_tokens: int = 262144

    def check(
        self, params: SamplingParams, prompts: Sequence[str | Sequence[int]], max_model_len: int
    ) -> None:
        """InvalidRequestError for the first bound the request exceeds. A sample generates
        at most up to the context's end (max_tokens past it is the engine's 400 to give), and
        one without max_tokens is counted so. A prompt whose logprobs are asked for counts
        its tokens once per sample (a text prompt as its UTF-8 bytes: no token is shorter)."""
        num_prompts = len(prompts)
        if num_prompts > self.max_prompts_per_request:
            _refuse(
                f"{num_prompts} prompts",
                self.max_prompts_per_request,
                "prompts-per-request",
                "prompt",
            )
        if len(params.stop) > self.max_stop_strings:
            _refuse(
                f"{len(params.stop)} stop strings", self.max_stop_strings, "stop-strings", "stop"
            )
        stop_chars = sum(len(s) for s in params.stop)
        if stop_chars > self.max_stop_chars:
            _refuse(
                f"{stop_chars} characters of stop strings",
                self.max_stop_chars,
                "stop-chars",
                "stop",
            )
        per_sample = min(params.max_tokens or max_model_len, max_model_len)
        total = num_prompts * params.n * per_sample
        if total > self.max_request_tokens:
            _refuse(
                f"up to {total} generated tokens (prompts x n x max_tokens = {num_prompts} x "
                f"{params.n} x {per_sample})",
                self.max_request_tokens,
                "request-tokens",
                "max_tokens",
            )
        if params.prompt_logprobs is None:
            return
        scored = sum(min(prompt_token_bound(p), max_model_len) for p in prompts) * params.n
        if total + scored > self.max_request_tokens:
            _refuse(
                f"up to {total + scored} tokens ({total} generated, and {scored} prompt tokens "
                f"scored: prompt logprobs for each of n = {params.n} samples)",
                self.max_request_tokens,
                "request-tokens",
                "prompt_logprobs",
            )


def prompt_token_bound(prompt: str | Sequence[int]) -> int:
    """At most this many tokens: a token list's length, or a text's UTF-8 bytes and one for
    a BOS (a byte-level tokenizer's token holds at least one byte)."""
    return len(prompt.encode()) + 1 if isinstance(prompt, str) else len(prompt)


def _refuse(what: str, bound: int, flag: str, field: str) -> None:
    raise InvalidRequestError(f"the request asks for {what}; at most {bound} (--max-{flag})", field)
