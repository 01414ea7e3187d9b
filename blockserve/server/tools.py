"""Tool calling on `/v1/chat/completions`: `tools` and `tool_choice`, enforced by the grammar."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from blockserve.errors import InvalidRequestError
from blockserve.sampling_params import StructuredOutputsParams
from blockserve.server.constraints import NamedToolChoice
from blockserve.server.protocol import ChatCompletionRequest

_ANY_OBJECT: dict[str, Any] = {"type": "object"}


@dataclass(frozen=True)
class ToolPlan:
    """What a chat request's tools ask of generation and of the reply.

    `tool_choice: "required"` constrains the output to a JSON array of one or more calls, each
    `{"name": <one of the tools>, "parameters": <that tool's schema>}`; a named function
    constrains it to that function's arguments. Either way the output parses by construction,
    and the reply carries OpenAI's `tool_calls` (with `finish_reason: "tool_calls"` for
    "required", and "stop" for a named function, as OpenAI and vLLM answer). `"none"` generates
    text. `"auto"` (OpenAI's default once tools are given) lets the model choose, and reads its
    calls out of its text in the model's own format: it needs `--enable-auto-tool-choice
    --tool-call-parser hermes` (vLLM's flags; the hermes format, `<tool_call>{"name": ...,
    "arguments": ...}</tool_call>`, is the one Qwen2.5, Hermes and many others are trained on),
    and without them is a 400 naming `tool_choice`, as vLLM answers.
    """

    mode: str  # "none", "required", "named" or "auto"
    function: str | None = None  # the named function
    constraint: StructuredOutputsParams | None = None
    tools: tuple[dict[str, Any], ...] = ()  # for the chat template, in OpenAI's shape


def plan_tools(body: ChatCompletionRequest, tool_call_parser: str | None = None) -> ToolPlan:
    """The request's tool plan; InvalidRequestError naming the field at fault. "auto" needs
    the server's `tool_call_parser` (None: auto tool choice is off)."""
    tools = body.tools or []
    choice = body.tool_choice
    if not tools:
        if choice not in (None, "none"):
            raise InvalidRequestError("tool_choice needs tools", "tool_choice")
        return ToolPlan("none")
    shapes = tuple(tool.model_dump(by_alias=True, exclude_none=True) for tool in tools)
    if choice is None or choice == "auto":
        if tool_call_parser is None:
            raise InvalidRequestError(
                'tool_choice "auto" (the default once tools are given) needs the server '
                "started with --enable-auto-tool-choice --tool-call-parser; send "
                '"required", a named function, or "none"',
                "tool_choice",
            )
        return ToolPlan("auto", tools=shapes)
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
        return ToolPlan(
            mode="named",
            function=name,
            constraint=StructuredOutputsParams(json=schema),
            tools=shapes,
        )
    calls = _required_calls_schema(tools, body.parallel_tool_calls)
    return ToolPlan("required", constraint=StructuredOutputsParams(json=calls), tools=shapes)


def _required_calls_schema(tools: list[Any], parallel: bool) -> dict[str, Any]:
    """The JSON schema of `tool_choice: "required"`'s output: one call or more (one at most
    without parallel calls), each naming one of `tools` with parameters of its schema."""
    calls: dict[str, Any] = {
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
    if not parallel:
        calls["maxItems"] = 1
    return calls


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _call(name: str, arguments: str, index: int | None = None) -> dict[str, Any]:
    function = {"name": name, "arguments": arguments}
    call = {"id": _call_id(), "type": "function", "function": function}
    return call if index is None else {"index": index, **call}


def reply_message(
    plan: ToolPlan, text: str, role: str = "assistant", reason: str | None = "stop"
) -> tuple[dict[str, Any], bool]:
    """A finished output's message (in `role`), and whether it calls tools. An output cut
    short by max_tokens (`reason` "length"): a named function's call carries its partial
    arguments (OpenAI's answer), and "required"'s array, never closed, is no list of calls:
    no call at all, as vLLM parses it (a stream has sent the calls that completed)."""
    if plan.mode == "none":
        return {"role": role, "content": text}, False
    if plan.mode == "named":
        assert plan.function is not None
        calls = [_call(plan.function, text)]
        return {"role": role, "content": None, "tool_calls": calls}, True
    if plan.mode == "required" and reason == "length":
        return {"role": role, "content": None}, False
    stream = ToolCallStream(plan)
    delta = stream.delta(text, finished=True)
    calls = [
        {k: v for k, v in call.items() if k != "index"} for call in delta.get("tool_calls", [])
    ]
    message: dict[str, Any] = {"role": role, "content": delta.get("content") or None}
    if calls:
        message["tool_calls"] = calls
    return message, bool(calls)


def finish_reason(plan: ToolPlan, reason: str | None, called: bool) -> str | None:
    """OpenAI's: "tool_calls" when the model chose to call ("required", "auto"); a named
    function's forced call keeps "stop"."""
    if called and reason == "stop" and plan.mode in ("required", "auto"):
        return "tool_calls"
    return reason


_OPEN, _CLOSE = "<tool_call>", "</tool_call>"


@dataclass
class ToolCallStream:
    """Turns one choice's text deltas into chat deltas. A named function's arguments stream
    as they are generated; "required" calls are sent whole, one delta per call, as each
    element of the array completes; under "auto" (the hermes format) text outside
    `<tool_call>` blocks is content, and each block is sent whole as it closes."""

    plan: ToolPlan
    _text: str = ""
    _pos: int = 0
    _opened: bool = False
    _sent: int = 0
    _decoder: json.JSONDecoder = field(default_factory=json.JSONDecoder)

    def delta(self, text: str, finished: bool = False) -> dict[str, Any]:
        """The chat delta for `text` (empty when nothing is ready to send)."""
        if self.plan.mode == "named":
            assert self.plan.function is not None
            if not text:
                return {}
            if self._sent == 0:
                self._sent = 1
                return {"tool_calls": [_call(self.plan.function, text, 0)]}
            return {"tool_calls": [{"index": 0, "function": {"arguments": text}}]}
        if self.plan.mode == "auto":
            return self._hermes(text, finished)
        calls = []
        for call in self._complete_elements(text):
            arguments = json.dumps(call["parameters"], ensure_ascii=False)
            calls.append(_call(call["name"], arguments, self._sent))
            self._sent += 1
        return {"tool_calls": calls} if calls else {}

    @property
    def called(self) -> bool:
        return self._sent > 0

    def _hermes(self, text: str, finished: bool) -> dict[str, Any]:
        """Content up to the next `<tool_call>` (holding back what may be the start of one),
        and each block that closed, parsed as {"name", "arguments"}; a block that does not
        parse is content. At the end, whatever is held is content."""
        self._text += text
        content: list[str] = []
        calls: list[dict[str, Any]] = []

        def add(segment: str) -> None:
            if segment.strip() or not self._sent:  # whitespace after a call is not content
                content.append(segment)

        while True:
            rest = self._text[self._pos :]
            start = rest.find(_OPEN)
            if start < 0:
                keep = 0 if finished else _partial_suffix(rest, _OPEN)
                add(rest[: len(rest) - keep])
                self._pos += len(rest) - keep
                break
            add(rest[:start])
            end = rest.find(_CLOSE, start)
            if end < 0:
                self._pos += start
                if finished:  # a block never closed: it is text
                    add(rest[start:])
                    self._pos = len(self._text)
                break
            call = _hermes_call(rest[start + len(_OPEN) : end])
            if call is None:
                add(rest[start : end + len(_CLOSE)])
            else:
                calls.append(_call(*call, self._sent))
                self._sent += 1
            self._pos += end + len(_CLOSE)
        delta: dict[str, Any] = {}
        if "".join(content):
            delta["content"] = "".join(content)
        if calls:
            delta["tool_calls"] = calls
        return delta

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


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of `text` that begins `marker`."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


def _hermes_call(body: str) -> tuple[str, str] | None:
    """(name, arguments JSON) of one `<tool_call>` block, or None if it is not one."""
    try:
        value = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", {})
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return value["name"], text


def _skip_space(text: str, i: int) -> int:
    while i < len(text) and text[i] in " \t\r\n":
        i += 1
    return i
