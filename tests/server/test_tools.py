"""Tool-call replies and stream deltas from generated text, for each tool_choice mode."""

from __future__ import annotations

import json
from typing import Any

import pytest

from blockserve.server.tools import ToolCallStream, ToolPlan, finish_reason, reply_message

AUTO = ToolPlan("auto")
REQUIRED = ToolPlan("required")
HERMES = (
    "Let me check.\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {"zone": "cet"}}\n</tool_call>'
)


def functions(message: dict[str, Any]) -> list[tuple[str, str]]:
    return [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]]


def test_auto_reads_hermes_blocks_and_keeps_the_text_before() -> None:
    message, called = reply_message(AUTO, HERMES)
    assert called and message["content"] == "Let me check.\n"
    assert functions(message) == [
        ("get_weather", '{"city": "Paris"}'),
        ("get_time", '{"zone": "cet"}'),
    ]
    assert all(
        c["id"].startswith("call_") and c["type"] == "function" for c in message["tool_calls"]
    )
    assert "index" not in message["tool_calls"][0]
    assert finish_reason(AUTO, "stop", called) == "tool_calls"
    assert finish_reason(AUTO, "length", called) == "length"


@pytest.mark.parametrize(
    "text",
    [
        "Paris is sunny.",
        "<tool_call>\nnot json\n</tool_call>",
        '<tool_call>{"arguments": {}}</tool_call>',  # no name
        '<tool_call>{"name": "get_weather"',  # never closed (cut by max_tokens)
    ],
)
def test_auto_text_without_a_valid_block_is_content(text: str) -> None:
    message, called = reply_message(AUTO, text)
    assert message == {"role": "assistant", "content": text} and not called
    assert finish_reason(AUTO, "stop", called) == "stop"


def stream(plan: ToolPlan, text: str, size: int) -> tuple[str, list[tuple[str, str]]]:
    """Feed `text` in pieces of `size` characters; the content and calls a client assembles."""
    tracker = ToolCallStream(plan)
    content = ""
    calls: dict[int, list[str]] = {}
    pieces = [text[i : i + size] for i in range(0, len(text), size)]
    for number, piece in enumerate(pieces):
        delta = tracker.delta(piece, finished=number == len(pieces) - 1)
        content += delta.get("content", "")
        for call in delta.get("tool_calls", []):
            entry = calls.setdefault(call["index"], ["", ""])
            entry[0] += call.get("function", {}).get("name", "")
            entry[1] += call["function"]["arguments"]
    return content, [(name, arguments) for name, arguments in calls.values()]


@pytest.mark.parametrize("size", [1, 3, 7, 1000])
def test_auto_stream_reassembles_to_the_reply(size: int) -> None:
    message, _ = reply_message(AUTO, HERMES)
    assert stream(AUTO, HERMES, size) == (message["content"], functions(message))


def test_auto_stream_holds_back_what_may_open_a_block() -> None:
    tracker = ToolCallStream(AUTO)
    assert tracker.delta("Hi <tool_") == {"content": "Hi "}
    assert tracker.delta("x") == {"content": "<tool_x"}
    assert tracker.delta(" <", finished=True) == {"content": " <"}


@pytest.mark.parametrize("size", [1, 5, 1000])
def test_required_stream_reassembles_to_the_reply(size: int) -> None:
    text = json.dumps(
        [
            {"name": "get_weather", "parameters": {"city": "Paris"}},
            {"name": "get_time", "parameters": {"zone": "utc"}},
        ]
    )
    message, called = reply_message(REQUIRED, text)
    assert called and message["content"] is None
    assert functions(message) == [
        ("get_weather", '{"city": "Paris"}'),
        ("get_time", '{"zone": "utc"}'),
    ]
    assert stream(REQUIRED, text, size) == ("", functions(message))
    assert finish_reason(REQUIRED, "stop", called) == "tool_calls"


def test_required_calls_cut_by_max_tokens_are_no_calls() -> None:
    """The array never closed: no call is reported with "length" (vLLM parses the whole
    output as a list of calls, and a cut one is none); the same text finished is two calls."""
    complete = '[{"name": "get_time", "parameters": {"zone": "utc"}}'
    cut = complete + ', {"name": "get_weather", "parameters": {"ci'
    message, called = reply_message(REQUIRED, cut, reason="length")
    assert (message, called) == ({"role": "assistant", "content": None}, False)
    assert finish_reason(REQUIRED, "length", called) == "length"
    message, called = reply_message(REQUIRED, complete + "]", reason="stop")
    assert called and functions(message) == [("get_time", '{"zone": "utc"}')]


def test_named_function_streams_its_arguments_as_generated() -> None:
    plan = ToolPlan("named", "get_weather")
    message, called = reply_message(plan, '{"city": "Paris"}')
    assert functions(message) == [("get_weather", '{"city": "Paris"}')] and called
    assert finish_reason(plan, "stop", called) == "stop"  # OpenAI's answer for a named call
    tracker = ToolCallStream(plan)
    first = tracker.delta('{"ci')
    assert first["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"ci'}
    assert tracker.delta('ty": 1}') == {
        "tool_calls": [{"index": 0, "function": {"arguments": 'ty": 1}'}}]
    }
