"""What one HTTP request may ask of the engine, checked before anything is queued: prompts per
request, stop strings (their count and total length), and generated tokens in all
(prompts × n × max_tokens). Each exceeded bound is a 400 naming the field and its flag."""

from __future__ import annotations

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

    def check(self, params: SamplingParams, num_prompts: int, max_model_len: int) -> None:
        """InvalidRequestError for the first bound the request exceeds. A sample generates
        at most up to the context's end (max_tokens past it is the engine's 400 to give), and
        one without max_tokens is counted so."""
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


def _refuse(what: str, bound: int, flag: str, field: str) -> None:
    raise InvalidRequestError(f"the request asks for {what}; at most {bound} (--max-{flag})", field)
