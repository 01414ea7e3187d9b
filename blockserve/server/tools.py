"""Tool calling on `/v1/chat/completions`: `tools` and `tool_choice`, enforced by the grammar.

`tool_choice: "required"` constrains the output to a JSON array of one or more calls, each
`{"name": <one of the tools>, "parameters": <that tool's schema>}`; a named function constrains
it to that function's arguments. Either way the output parses by construction, and the reply
carries OpenAI's `tool_calls` (with `finish_reason: "tool_calls"` for "required", and "stop"
for a named function, as OpenAI and vLLM answer). `"none"` generates text. `"auto"` (OpenAI's
default once tools are given) needs a parser for the model's own tool-call syntax, which
blockserve does not have: it is a 400 naming `tool_choice`, as vLLM answers when started
without a tool parser.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from blockserve.errors import InvalidRequestError
from blockserve.sampling_params import StructuredOutputsParams
from blockserve.server.protocol import ChatCompletionRequest, NamedToolChoice

_ANY_OBJECT: dict[str, Any] = {"type": "object"}


@dataclass(frozen=True)
class ToolPlan:
    """What a chat request's tools ask of generation and of the reply."""

    mode: str  # "none", "required" or "named"
    function: str | None = None  # the named function
    constraint: StructuredOutputsParams | None = None
    tools: tuple[dict[str, Any], ...] = ()  # for the chat template, in OpenAI's shape


def plan_tools(body: ChatCompletionRequest) -> ToolPlan:
    """The request's tool plan; InvalidRequestError naming the field at fault."""
    tools = body.tools or []
    choice = body.tool_choice
    if not tools:
        if choice not in (None, "none"):
            raise InvalidRequestError("tool_choice needs tools", "tool_choice")
        return ToolPlan("none")
    shapes = tuple(tool.model_dump(by_alias=True, exclude_none=True) for tool in tools)
    if choice is None or choice == "auto":
        raise InvalidRequestError(
            'tool_choice "auto" (the default once tools are given) needs a parser for this '
            "model's tool-call format, which blockserve does not have; send "
            '"required", a named function, or "none"',
            "tool_choice",
        )
    if choice == "none":
        return ToolPlan("none", tools=shapes)
    if body.constraint() is not None:
        raise InvalidRequestError(
            "a tool_choice that calls tools cannot be combined with response_format or "
            "structured_outputs",
            "tool_choice",
        )
    if isinstance(choice, NamedToolChoice):
        name = choice.function.name
        chosen = [tool.function for tool in tools if tool.function.name == name]
        if not chosen:
            raise InvalidRequestError(
                f"tool_choice names {name!r}, which is not in tools", "tool_choice"
            )
        schema = chosen[0].parameters or _ANY_OBJECT
        return ToolPlan("named", name, StructuredOutputsParams(json=schema), shapes)
    calls = {
        "type": "array",
        "minItems": 1,
        "items": {
            "anyOf": [
                {
                    "type": "object",
                    "properties": {
                        "name": {"type": "string", "enum": [tool.function.name]},
                        "parameters": tool.function.parameters or _ANY_OBJECT,
                    },
                    "required": ["name", "parameters"],
                    "additionalProperties": False,
                }
                for tool in tools
            ]
        },
    }
    if not body.parallel_tool_calls:
        calls["maxItems"] = 1
    return ToolPlan("required", constraint=StructuredOutputsParams(json=calls), tools=shapes)


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _call(name: str, arguments: str, index: int | None = None) -> dict[str, Any]:
    function = {"name": name, "arguments": arguments}
    call = {"id": _call_id(), "type": "function", "function": function}
    return call if index is None else {"index": index, **call}


def tool_calls(plan: ToolPlan, text: str) -> list[dict[str, Any]] | None:
    """The calls in a finished output (None when the plan calls no tool). An output cut short
    by max_tokens keeps what the stream would have sent: a named function's partial
    arguments, or the "required" calls that completed."""
    if plan.mode == "named":
        assert plan.function is not None
        return [_call(plan.function, text)]
    if plan.mode == "required":
        return ToolCallStream(plan).delta(text).get("tool_calls", [])
    return None


def finish_reason(plan: ToolPlan, reason: str | None, called: bool) -> str | None:
    return "tool_calls" if plan.mode == "required" and called and reason == "stop" else reason


@dataclass
class ToolCallStream:
    """Turns one choice's text deltas into `tool_calls` deltas. A named function's arguments
    stream as they are generated; "required" calls are sent whole, one delta per call, as
    each element of the array completes."""

    plan: ToolPlan
    _text: str = ""
    _pos: int = 0
    _opened: bool = False
    _sent: int = 0
    _decoder: json.JSONDecoder = field(default_factory=json.JSONDecoder)

    def delta(self, text: str) -> dict[str, Any]:
        """The chat delta for `text` (empty when nothing is ready to send)."""
        if self.plan.mode == "named":
            assert self.plan.function is not None
            if not text:
                return {}
            if self._sent == 0:
                self._sent = 1
                return {"tool_calls": [_call(self.plan.function, text, 0)]}
            return {"tool_calls": [{"index": 0, "function": {"arguments": text}}]}
        calls = []
        for call in self._complete_elements(text):
            arguments = json.dumps(call["parameters"], ensure_ascii=False)
            calls.append(_call(call["name"], arguments, self._sent))
            self._sent += 1
        return {"tool_calls": calls} if calls else {}

    @property
    def called(self) -> bool:
        return self._sent > 0

    def _complete_elements(self, text: str) -> list[Any]:
        """Elements of the JSON array that completed with `text` (the grammar guarantees
        the array's shape, so a parse that fails means "not complete yet")."""
        self._text += text
        found: list[Any] = []
        while True:
            i = _skip_space(self._text, self._pos)
            if not self._opened:
                if i >= len(self._text) or self._text[i] != "[":
                    return found
                self._opened, self._pos = True, i + 1
                continue
            if i < len(self._text) and self._text[i] == ",":
                i = _skip_space(self._text, i + 1)
            if i >= len(self._text) or self._text[i] == "]":
                return found
            try:
                value, end = self._decoder.raw_decode(self._text, i)
            except json.JSONDecodeError:
                return found
            found.append(value)
            self._pos = end


def _skip_space(text: str, i: int) -> int:
    while i < len(text) and text[i] in " \t\r\n":
        i += 1
    return i
