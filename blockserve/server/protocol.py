"""OpenAI-compatible request models (pydantic), with vLLM's extra fields."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar, Literal

from pydantic import ConfigDict, Field, model_validator

from blockserve.engine.request import TextPrompt, as_prompt_list, image_part
from blockserve.errors import InvalidRequestError
from blockserve.sampling_params import SamplingParams, StructuredOutputsParams
from blockserve.server.body import Body, Text, encodable
from blockserve.server.constraints import (
    UNSUPPORTED_FIELDS,
    ChatTool,
    ResponseFormat,
    StructuredOutputs,
    ToolChoice,
    refuse_unsupported,
)

# Field names and defaults follow OpenAI's API; the extras are vLLM's (`cache_salt`, `priority`,
# `top_k`, `min_p`, `repetition_penalty`, `ignore_eos`, `min_tokens`, `stop_token_ids`,
# `skip_special_tokens`, `include_stop_str_in_output`, `request_id`, `return_token_ids`,
# `structured_outputs`). Validation failures become 400 errors in OpenAI's shape (see errors.py).
# Unknown fields are ignored, as OpenAI does, but a field OpenAI or vLLM defines that blockserve
# does not implement is a 400 naming it when set, never silently dropped. Types are strict, as the
# OpenAPI document states them: `"n": "2"`, `"max_tokens": 16.0` or `"stream": "true"` are 400s,
# not quietly converted (a float field takes an integer).


class StreamOptions(Body):
    include_usage: bool = False


class _SamplingFields(Body):
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
    logit_bias: dict[str, float] | None = None
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    cache_salt: str | None = None
    priority: int = 0
    request_id: str | None = None
    return_token_ids: bool = False
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    # blockserve's: usage.cache_explanation says where the prefix-cache match stopped and why
    return_cache_explanation: bool = False

    unsupported_fields: ClassVar[tuple[str, ...]] = UNSUPPORTED_FIELDS

    @model_validator(mode="before")
    @classmethod
    def _refuse(cls, data: Any) -> Any:
        return refuse_unsupported(data, cls.unsupported_fields)

    @model_validator(mode="after")
    def _check(self) -> _SamplingFields:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options can only be set when stream is true")
        if self.prompt_logprobs is not None and self.stream:
            raise ValueError("prompt_logprobs are not available when stream is true")
        return self

    def constraint(self) -> StructuredOutputsParams | None:
        """The output constraint asked for by `response_format` or `structured_outputs`."""
        from_format = self.response_format.constraint() if self.response_format else None
        if self.structured_outputs is None:
            return from_format
        if from_format is not None:
            raise InvalidRequestError(
                "give response_format or structured_outputs, not both", "structured_outputs"
            )
        return self.structured_outputs.constraint()

    def requested_max_tokens(self) -> int | None:
        """The request's own token limit (None: none given)."""
        return self.max_tokens

    def decide_max_tokens(
        self, default: int | None, defaults: Mapping[str, float | int] | None = None
    ) -> int | None:
        """The one place a request's max_tokens is decided: its own value, else `default`
        (None: up to the context's end); the model's generation-config max_tokens caps either,
        as vLLM's does. Whether prompt and max_tokens fit the context is the input processor's
        check (a 400, never a silent cut); the scheduler stops the sample when it is reached."""
        chosen = self.requested_max_tokens()
        chosen = default if chosen is None else chosen
        cap = (defaults or {}).get("max_tokens")
        if cap is None:
            return chosen
        return int(cap) if chosen is None else min(chosen, int(cap))

    def sampling_params(
        self,
        default_max_tokens: int | None,
        logprobs: int | None,
        constraint: StructuredOutputsParams | None = None,
        defaults: Mapping[str, float | int] | None = None,
        prompt_logprobs: int | None = None,
    ) -> SamplingParams:
        """The engine's SamplingParams; InvalidRequestError for out-of-range values. A field
        the request leaves unset takes the model's generation-config default, if any, else
        the API's; max_tokens is `decide_max_tokens(default_max_tokens, defaults)`;
        prompt_logprobs is the request's, else `prompt_logprobs` (echo's)."""
        defaults = defaults or {}
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

        def pick(value: float | None, name: str, neutral: float) -> float:
            return value if value is not None else defaults.get(name, neutral)

        max_tokens = self.decide_max_tokens(default_max_tokens, defaults)
        return SamplingParams(
            n=self.n,
            temperature=pick(self.temperature, "temperature", 1.0),
            top_p=pick(self.top_p, "top_p", 1.0),
            top_k=int(pick(self.top_k, "top_k", 0)),
            min_p=pick(self.min_p, "min_p", 0.0),
            repetition_penalty=pick(self.repetition_penalty, "repetition_penalty", 1.0),
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
            structured_outputs=constraint,
            logit_bias=dict(self.logit_bias) if self.logit_bias is not None else None,
            prompt_logprobs=self.prompt_logprobs
            if self.prompt_logprobs is not None
            else prompt_logprobs,
        )


class CompletionRequest(_SamplingFields):
    unsupported_fields = (*UNSUPPORTED_FIELDS, "suffix", "best_of")

    prompt: Text | list[Text] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False

    def prompts(self) -> list[TextPrompt]:
        """One entry per prompt: a string or a tuple of token ids."""
        return as_prompt_list(self.prompt)


class ChatMessage(Body):
    model_config = ConfigDict(extra="allow", strict=True)

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: Text | list[dict[str, Any]] | None = None

    def text(self) -> str:
        """The message's text; content parts other than text are refused."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        for part in self.content:
            if part.get("type") != "text":
                raise InvalidRequestError(
                    f"content part type {part.get('type')!r} is not supported"
                )
        return "".join(part["text"] for part in self.parts())

    def has_images(self) -> bool:
        return isinstance(self.content, list) and any(
            part.get("type") == "image_url" for part in self.content
        )

    def parts(self) -> list[dict[str, Any]]:
        """The content as parts: `{"type": "text", "text"}`, and `{"type": "image", "url"}`
        for OpenAI's `image_url` parts (the URL as given, or inside `{"url": ...}`)."""
        if self.content is None or isinstance(self.content, str):
            return [{"type": "text", "text": self.content or ""}]
        parts: list[dict[str, Any]] = []
        for part in self.content:
            kind = part.get("type")
            if kind == "text":
                try:
                    parts.append({"type": "text", "text": encodable(str(part.get("text", "")))})
                except ValueError as exc:
                    raise InvalidRequestError(str(exc), "messages") from None
            elif kind == "image_url":
                parts.append(image_part(part))
            else:
                raise InvalidRequestError(f"content part type {kind!r} is not supported")
        return parts


class ChatCompletionRequest(_SamplingFields):
    unsupported_fields = (
        *UNSUPPORTED_FIELDS,
        "functions",
        "function_call",
        "audio",
        "prediction",
        "web_search_options",
    )

    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[ChatTool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True

    def requested_max_tokens(self) -> int | None:
        """max_completion_tokens (OpenAI's current name) wins over max_tokens."""
        return (
            self.max_completion_tokens
            if self.max_completion_tokens is not None
            else self.max_tokens
        )

    def num_logprobs(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequestError("top_logprobs requires logprobs to be true")
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeRequest(Body):
    model: str | None = None
    prompt: Text | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_special_tokens: bool = True

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        return self


class DetokenizeRequest(Body):
    model: str | None = None
    tokens: list[int]
