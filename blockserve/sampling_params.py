"""`SamplingParams`: how one request's tokens are chosen and when its generation stops.

Shaped like vLLM's (same field names and defaults), validated on construction with typed errors.
Torch-free: the scheduler reads the stop conditions, the sampler reads the rest.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from blockserve.errors import InvalidRequestError

# What torch.Generator.manual_seed takes: the seeds of all `n` samples (seed + index) must fit.
_MIN_SEED, _MAX_SEED = -(2**63), 2**64 - 1
_FLOAT_FIELDS = (
    "temperature",
    "top_p",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
)


@dataclass(frozen=True, slots=True)
class StructuredOutputsParams:
    """A constraint on what a request may generate, as vLLM's `structured_outputs` states it:
    exactly one of a JSON schema (`json`, a dict or its JSON text), any JSON object
    (`json_object`), a regular expression, a list of strings to choose from, or a grammar (GBNF,
    as llama.cpp and vLLM take it, or Lark). The grammar engine (blockserve/grammar.py) checks
    it; a schema, pattern or grammar it cannot compile is refused there, naming the field."""

    json: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None

    def __init__(
        self,
        json: str | dict[str, Any] | None = None,
        json_object: bool = False,
        regex: str | None = None,
        choice: list[str] | tuple[str, ...] | None = None,
        grammar: str | None = None,
    ) -> None:
        # A schema is kept as JSON text (hashable; the grammar engine's cache key). Key order
        # is kept: it is the order the object's properties are generated in.
        text = json if json is None or isinstance(json, str) else _json_text(json)
        object.__setattr__(self, "json", text)
        object.__setattr__(self, "json_object", json_object)
        object.__setattr__(self, "regex", regex)
        object.__setattr__(self, "choice", None if choice is None else tuple(choice))
        object.__setattr__(self, "grammar", grammar)
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name)]
        given += ["json_object"] if json_object else []
        if len(given) != 1:
            raise InvalidRequestError(
                "structured outputs take exactly one of json, json_object, regex, choice and "
                f"grammar, got {', '.join(given) or 'none'}",
                "structured_outputs",
            )
        if self.choice is not None and not all(isinstance(c, str) and c for c in self.choice):
            raise InvalidRequestError(
                "structured_outputs.choice must be a list of non-empty strings",
                "structured_outputs",
            )

    @property
    def kind(self) -> str:
        """Which constraint this is: "json", "json_object", "regex", "choice" or "grammar"."""
        for name in ("json", "regex", "choice", "grammar"):
            if getattr(self, name):
                return name
        return "json_object"


def _json_text(value: dict[str, Any]) -> str:
    return json.dumps(value, separators=(",", ":"))


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Sampling and stopping for one request (one of its `n` samples each).

    `temperature == 0` means greedy. `top_k` of 0 or -1 disables top-k; `top_p == 1` and
    `min_p == 0` disable those filters. Penalties follow vLLM's definitions: repetition
    divides positive (multiplies negative) logits of tokens seen in the prompt or output;
    presence subtracts a constant from tokens seen in the output; frequency subtracts in
    proportion to their count in the output.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None
    # Added to the raw logits before sampling (token id -> bias, clamped to [-100, 100] as
    # vLLM clamps it); logprobs stay those of the raw distribution. Ids may come as strings
    # of digits, as JSON keys are; they are stored as ints.
    logit_bias: dict[Any, float] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        self._validate()
        if self.logit_bias is not None:
            bias = _checked_logit_bias(self.logit_bias)
            object.__setattr__(self, "logit_bias", bias or None)

    def _validate(self) -> None:
        def fail(message: str) -> None:
            raise InvalidRequestError(message)

        if self.n < 1:
            fail(f"n must be at least 1, got {self.n}")
        for name in _FLOAT_FIELDS:  # NaN passes every comparison below: refuse it first
            if not math.isfinite(getattr(self, name)):
                fail(f"{name} must be a finite number, got {getattr(self, name)}")
        if self.seed is not None and not _MIN_SEED <= self.seed <= _MAX_SEED - (self.n - 1):
            fail(
                f"seed must be in [{_MIN_SEED}, {_MAX_SEED - (self.n - 1)}] for n={self.n} "
                f"(each sample draws with seed + its index), got {self.seed}"
            )
        if self.temperature < 0:
            fail(f"temperature must be non-negative, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            fail(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            fail(f"top_k must be -1 (disable), 0 (disable) or positive, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            fail(f"min_p must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty <= 0:
            fail(f"repetition_penalty must be positive, got {self.repetition_penalty}")
        if not -2 <= self.presence_penalty <= 2:
            fail(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2 <= self.frequency_penalty <= 2:
            fail(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if self.max_tokens is not None and self.max_tokens < 1:
            fail(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            fail(f"min_tokens must be non-negative, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            fail(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        for name in ("logprobs", "prompt_logprobs"):  # the most: the engine's --max-logprobs
            value = getattr(self, name)
            if value is not None and value < 0:
                fail(f"{name} must be non-negative, got {value}")
        if any(not s for s in self.stop):
            fail("stop strings must be non-empty")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def uses_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )


MAX_LOGIT_BIAS_ENTRIES = 300  # one request's logit_bias entries (OpenAI's limit)


def _checked_logit_bias(bias: Any) -> dict[int, float]:
    """`bias` as {token id: value in [-100, 100]}; InvalidRequestError naming `logit_bias`
    for anything else. Token ids are checked against the vocabulary by the engine."""
    if not isinstance(bias, dict):
        raise InvalidRequestError("logit_bias must map token ids to numbers", "logit_bias")
    if len(bias) > MAX_LOGIT_BIAS_ENTRIES:
        raise InvalidRequestError(
            f"logit_bias may have at most {MAX_LOGIT_BIAS_ENTRIES} entries, got {len(bias)}",
            "logit_bias",
        )
    checked = {}
    for key, value in bias.items():
        token = _token_id(key)
        if token is None or isinstance(value, bool) or not isinstance(value, (int, float)):
            raise InvalidRequestError(
                f"logit_bias must map token ids to numbers, got {_short(key)}: {_short(value)}",
                "logit_bias",
            )
        if not math.isfinite(value):
            raise InvalidRequestError(
                f"logit_bias values must be finite, got {value}", "logit_bias"
            )
        checked[token] = min(100.0, max(-100.0, float(value)))
    return checked


def _token_id(key: Any) -> int | None:
    """A token id given as an int or, as JSON object keys are, a string of at most 10 ASCII
    digits (str.isdigit alone takes other scripts' digits, and any length)."""
    if isinstance(key, int) and not isinstance(key, bool) and key >= 0:
        return key
    if isinstance(key, str) and 0 < len(key) <= 10 and key.isascii() and key.isdigit():
        return int(key)
    return None


def _short(value: Any) -> str:
    """`value`'s repr, cut to 40 characters (an error message must not echo a huge key)."""
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:37]}..."
