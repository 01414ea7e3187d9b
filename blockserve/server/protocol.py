"""OpenAI-compatible request models (pydantic), with vLLM's extra fields.

Field names and defaults follow OpenAI's API; the extras are vLLM's (`cache_salt`, `priority`,
`top_k`, `min_p`, `repetition_penalty`, `ignore_eos`, `min_tokens`, `stop_token_ids`,
`skip_special_tokens`, `include_stop_str_in_output`, `request_id`, `return_token_ids`).
Validation failures become 400 errors in OpenAI's shape (see errors.py). Unknown fields are
ignored, as OpenAI does. Types are strict, as the OpenAPI document states them: `"n": "2"`,
`"max_tokens": 16.0` or `"stream": "true"` are 400s, not quietly converted (a float field
takes an integer).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from blockserve.engine.request import Prompt, as_prompt_list
from blockserve.errors import InvalidRequestError
from blockserve.sampling_params import SamplingParams


def _encodable(text: str) -> str:
    """JSON may spell lone surrogates ("\\ud800"); no tokenizer takes them."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"text is not valid Unicode: {exc.reason} at {exc.start}") from None
    return text


Text = Annotated[str, AfterValidator(_encodable)]


class _Body(BaseModel):
    """A request body, or a part of one: unknown fields ignored, types strict."""

    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(_Body):
    include_usage: bool = False


class _SamplingFields(_Body):
    """Fields shared by completions and chat completions."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    cache_salt: str | None = None
    priority: int = 0
    request_id: str | None = None
    return_token_ids: bool = False
    # blockserve's: usage.cache_explanation says where the prefix-cache match stopped and why
    return_cache_explanation: bool = False

    @model_validator(mode="after")
    def _check(self) -> _SamplingFields:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options can only be set when stream is true")
        return self

    def sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        """The engine's SamplingParams; InvalidRequestError for out-of-range values."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(
            n=self.n,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0,
            min_p=self.min_p or 0.0,
            repetition_penalty=self.repetition_penalty or 1.0,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            seed=self.seed,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            stop=tuple(stop),
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
            include_stop_str_in_output=self.include_stop_str_in_output,
            logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens,
        )


class CompletionRequest(_SamplingFields):
    prompt: Text | list[Text] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False

    def prompts(self) -> list[Prompt]:
        """One entry per prompt: a string or a tuple of token ids."""
        return as_prompt_list(self.prompt)


class ChatMessage(_Body):
    model_config = ConfigDict(extra="allow", strict=True)

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: Text | list[dict[str, Any]] | None = None

    def text(self) -> str:
        """The message's text; content parts other than text are refused."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.get("type") != "text":
                raise InvalidRequestError(
                    f"content part type {part.get('type')!r} is not supported"
                )
            try:
                parts.append(_encodable(str(part.get("text", ""))))
            except ValueError as exc:
                raise InvalidRequestError(str(exc), "messages") from None
        return "".join(parts)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True

    def effective_max_tokens(self) -> int | None:
        return (
            self.max_completion_tokens
            if self.max_completion_tokens is not None
            else self.max_tokens
        )

    def num_logprobs(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequestError("top_logprobs requires logprobs to be true")
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeRequest(_Body):
    model: str | None = None
    prompt: Text | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_special_tokens: bool = True

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        return self


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int]
