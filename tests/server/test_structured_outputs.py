"""Structured outputs and tools over HTTP through the openai client: the tiny model for shapes
and refusals, the real default model for outputs that parse and validate, 20 of 20."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest

from blockserve.bench.server_process import ServerProcess
from tests.server.conftest import tiny_server

pytestmark = pytest.mark.slow  # a real server per module

# Enums and booleans only: even the tiny random model finishes these in a few tokens.
WEATHER = {
    "type": "object",
    "properties": {"unit": {"enum": ["c", "f"]}, "rain": {"type": "boolean"}},
    "required": ["unit", "rain"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "parameters": {
                "type": "object",
                "properties": {"zone": {"enum": ["utc", "cet"]}},
                "required": ["zone"],
                "additionalProperties": False,
            },
        },
    },
]
USER = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def client(
    tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[openai.OpenAI]:
    """The tiny model, with compact JSON: left any whitespace, its random weights pad every
    gap with 16 spaces (one token each in its byte-level vocabulary)."""
    for server in tiny_server(
        tiny_llama_dir, tmp_path_factory, ["--structured-outputs-max-whitespace", "0"]
    ):
        yield openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def auto_client(
    tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[openai.OpenAI]:
    flags = ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
    for server in tiny_server(tiny_llama_dir, tmp_path_factory, flags):
        yield openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


# What a hermes-format model writes when it calls a tool; a regex makes the tiny model write it.
HERMES_CALL = (
    'Checking.<tool_call>{"name": "get_weather", "arguments": {"unit": "c", "rain": true}}'
    "</tool_call>"
)


@pytest.mark.parametrize("stream", [False, True])
def test_auto_tool_choice_reads_the_models_hermes_calls(
    auto_client: openai.OpenAI, stream: bool
) -> None:
    """With --tool-call-parser hermes, tools without tool_choice ("auto") run free, and a
    `<tool_call>` block in the output becomes a tool call (streamed or not)."""
    kwargs: dict[str, Any] = {
        "model": None,
        "messages": USER,
        "tools": TOOLS,
        "max_tokens": 128,
        "extra_body": {"structured_outputs": {"regex": re.escape(HERMES_CALL)}},
    }
    if stream:
        calls, finish = collect_stream(auto_client, **kwargs)
        content = "".join(
            chunk.choices[0].delta.content or ""
            for chunk in auto_client.chat.completions.create(stream=True, **kwargs)
            if chunk.choices
        )
    else:
        choice = auto_client.chat.completions.create(**kwargs).choices[0]
        content, finish = choice.message.content or "", choice.finish_reason
        calls = [
            {"name": c.function.name, "arguments": c.function.arguments}  # type: ignore[union-attr]
            for c in choice.message.tool_calls or []
        ]
    assert content == "Checking."
    assert calls == [{"name": "get_weather", "arguments": '{"unit": "c", "rain": true}'}]
    assert finish == "tool_calls"


def test_auto_tool_choice_without_a_call_answers_in_text(auto_client: openai.OpenAI) -> None:
    out = auto_client.chat.completions.create(
        model=None,  # type: ignore[arg-type]
        messages=USER,  # type: ignore[arg-type]
        tools=TOOLS,  # type: ignore[arg-type]
        tool_choice="auto",
        max_tokens=32,
        extra_body={"structured_outputs": {"choice": ["It is sunny."]}},
    )
    assert out.choices[0].message.content == "It is sunny."
    assert out.choices[0].message.tool_calls is None
    assert out.choices[0].finish_reason == "stop"


def test_named_tool_call_has_openai_shape(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model=None,  # type: ignore[arg-type]
        messages=USER,  # type: ignore[arg-type]
        tools=TOOLS,  # type: ignore[arg-type]
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=128,
        temperature=0,
    )
    choice = out.choices[0]
    assert choice.finish_reason == "stop"  # OpenAI's and vLLM's answer for a named function
    assert choice.message.content is None
    (call,) = choice.message.tool_calls or []
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"  # type: ignore[union-attr]
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)  # type: ignore[union-attr]


def collect_stream(client: openai.OpenAI, **kwargs: Any) -> tuple[list[dict[str, str]], str]:
    """Reassemble streamed tool-call deltas by index, as a client does; and the finish."""
    calls: dict[int, dict[str, str]] = {}
    finish = None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"name": "", "arguments": ""})
                assert delta.function is not None
                call["name"] += delta.function.name or ""
                call["arguments"] += delta.function.arguments or ""
            finish = choice.finish_reason or finish
    assert finish is not None
    return [calls[i] for i in sorted(calls)], finish


@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "function": {"name": "get_time"}}]
)
def test_streamed_tool_calls_reassemble_to_the_whole_answer(
    client: openai.OpenAI, tool_choice: Any
) -> None:
    kwargs = {
        "model": None,
        "messages": USER,
        "tools": TOOLS,
        "tool_choice": tool_choice,
        "max_tokens": 256,
        "temperature": 0,
        "parallel_tool_calls": False,  # the tiny model would go on calling to max_tokens
    }
    whole = client.chat.completions.create(**kwargs).choices[0]  # type: ignore[call-overload]
    streamed, finish = collect_stream(client, **kwargs)
    expected = [
        {"name": c.function.name, "arguments": c.function.arguments}  # type: ignore[union-attr]
        for c in whole.message.tool_calls or []
    ]
    assert streamed == expected and len(expected) >= 1
    assert finish == whole.finish_reason == ("tool_calls" if tool_choice == "required" else "stop")
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for call in streamed:
        jsonschema.validate(json.loads(call["arguments"]), schemas[call["name"]])


def test_parallel_tool_calls_false_makes_one_call(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model=None,  # type: ignore[arg-type]
        messages=USER,  # type: ignore[arg-type]
        tools=TOOLS,  # type: ignore[arg-type]
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=256,
        temperature=0,
    )
    assert len(out.choices[0].message.tool_calls or []) == 1


def test_tool_choice_none_answers_in_text(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model=None,  # type: ignore[arg-type]
        messages=USER,  # type: ignore[arg-type]
        tools=TOOLS,  # type: ignore[arg-type]
        tool_choice="none",
        max_tokens=4,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert out.choices[0].message.tool_calls is None
    assert out.choices[0].finish_reason == "length"
    assert out.usage is not None and out.usage.completion_tokens == 4


@pytest.mark.parametrize(
    ("extra", "param", "words"),
    [
        ({"logits_processors": ["x"]}, "logits_processors", "logits_processors is not supported"),
        ({"guided_json": {"type": "object"}}, "guided_json", "use structured_outputs.json"),
        ({"functions": [{"name": "f"}]}, "functions", "functions is not supported"),
        ({"tools": TOOLS}, "tool_choice", 'tool_choice "auto" (the default once tools'),
        ({"tools": TOOLS, "tool_choice": "auto"}, "tool_choice", "--enable-auto-tool-choice"),
        ({"tool_choice": "required"}, "tool_choice", "tool_choice needs tools"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
            "'nope', which is not in tools",
        ),
        (
            {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
            "tool_choice",
            "cannot be combined with response_format",
        ),
        (
            {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
            "structured_outputs",
            "give response_format or structured_outputs, not both",
        ),
        ({"response_format": {"type": "json_schema"}}, "response_format", "needs json_schema"),
        ({"structured_outputs": {"regex": "(a"}}, "structured_outputs", "unclosed group"),
        ({"structured_outputs": {"json": "{"}}, "structured_outputs", "not valid JSON"),
        ({"structured_outputs": {}}, "structured_outputs", "exactly one"),
        (
            {"structured_outputs": {"regex": "a"}, "ignore_eos": True},
            "ignore_eos",
            "ignore_eos cannot be combined with structured outputs",
        ),
        (
            {"structured_outputs": {"choice": ["a"]}, "min_tokens": 3},
            "min_tokens",
            "the constraint decides where the output ends",
        ),
    ],
)
def test_unsupported_or_conflicting_fields_are_400s_naming_the_field(
    client: openai.OpenAI, extra: dict[str, Any], param: str, words: str
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=None,  # type: ignore[arg-type]
            messages=USER,  # type: ignore[arg-type]
            max_tokens=4,
            extra_body=extra,
        )
    error = caught.value.body
    assert isinstance(error, dict)
    assert error["param"] == param and words in error["message"], error


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"suffix": "!"}, "suffix"),
        ({"best_of": 2}, "best_of"),
    ],
)
def test_completions_refuse_unsupported_fields(
    client: openai.OpenAI, extra: dict[str, Any], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(
            model=None,  # type: ignore[arg-type]
            prompt="hi",
            max_tokens=4,
            extra_body=extra,
        )
    assert isinstance(caught.value.body, dict) and caught.value.body["param"] == param


def test_completions_take_structured_outputs(client: openai.OpenAI) -> None:
    out = client.completions.create(
        model=None,  # type: ignore[arg-type]
        prompt="the quick brown",
        max_tokens=32,
        n=3,
        seed=1,
        extra_body={"structured_outputs": {"choice": ["fox", "dog", "cat"]}},
    )
    assert [c.text in ("fox", "dog", "cat") for c in out.choices] == [True] * 3
    assert {c.finish_reason for c in out.choices} == {"stop"}


# The real default model: outputs that parse and validate.

BOOK = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 40},
        "year": {"type": "integer", "minimum": 1500, "maximum": 2030},
        "author": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 40},
                "country": {"enum": ["UK", "US", "FR", "other"]},
            },
            "required": ["name", "country"],
            "additionalProperties": False,
        },
        "genre": {"enum": ["fiction", "history", "science"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 3},
    },
    "required": ["title", "year", "author", "genre", "tags"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def default_client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    log = tmp_path_factory.mktemp("default-model") / "server.log"
    server = ServerProcess(["--max-model-len", "2048", "--dtype", "float32"], log)
    try:
        yield openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    finally:
        assert server.stop() == 0, server.log()


def test_default_model_json_schema_20_of_20_validate(default_client: openai.OpenAI) -> None:
    """A schema with a nested object, enums, bounds and an array: 20 samples, all valid."""
    out = default_client.chat.completions.create(
        model="SmolLM2-135M-Instruct",
        messages=[{"role": "user", "content": "Describe a book as JSON."}],
        n=20,
        seed=0,
        max_tokens=256,
        response_format={"type": "json_schema", "json_schema": {"name": "book", "schema": BOOK}},
    )
    assert len(out.choices) == 20
    for choice in out.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content or ""), BOOK)


def test_default_model_json_object_20_of_20_parse(default_client: openai.OpenAI) -> None:
    out = default_client.chat.completions.create(
        model="SmolLM2-135M-Instruct",
        messages=[{"role": "user", "content": "Reply with a JSON object with a name and an age."}],
        n=20,
        seed=0,
        temperature=0.7,
        max_tokens=256,
        response_format={"type": "json_object"},
    )
    assert len(out.choices) == 20
    for choice in out.choices:
        assert choice.finish_reason == "stop"
        assert isinstance(json.loads(choice.message.content or ""), dict)


def test_default_model_named_tool_call_parses_into_its_arguments(
    default_client: openai.OpenAI,
) -> None:
    parameters = {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 30},
            "unit": {"enum": ["celsius", "fahrenheit"]},
        },
        "required": ["city", "unit"],
        "additionalProperties": False,
    }
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": parameters}}]
    out = default_client.chat.completions.create(
        model="SmolLM2-135M-Instruct",
        messages=[{"role": "user", "content": "What is the weather in Paris, in celsius?"}],
        tools=tools,  # type: ignore[arg-type]
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=64,
        temperature=0,
    )
    (call,) = out.choices[0].message.tool_calls or []
    arguments = json.loads(call.function.arguments)  # type: ignore[union-attr]
    jsonschema.validate(arguments, parameters)
    assert arguments == {"city": "Paris", "unit": "celsius"}


def test_default_model_regex_and_grammar_on_completions(default_client: openai.OpenAI) -> None:
    phone = default_client.completions.create(
        model="SmolLM2-135M-Instruct",
        prompt="Call me at",
        max_tokens=16,
        n=5,
        seed=0,
        extra_body={"structured_outputs": {"regex": r" [0-9]{3}-[0-9]{4}"}},
    )
    assert [bool(re.fullmatch(r" [0-9]{3}-[0-9]{4}", c.text)) for c in phone.choices] == [True] * 5
    grammar = 'root ::= " " ("yes" | "no") "."'
    answer = default_client.completions.create(
        model="SmolLM2-135M-Instruct",
        prompt="Is Paris in France? Answer:",
        max_tokens=8,
        temperature=0,
        extra_body={"structured_outputs": {"grammar": grammar}},
    )
    assert answer.choices[0].text in (" yes.", " no.")  # the grammar's, whatever the model knows
    assert answer.choices[0].finish_reason == "stop"
