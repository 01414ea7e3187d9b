"""Every error case answers its documented status in OpenAI's shape; the server keeps serving."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

from blockserve.bench.server_process import ServerProcess

pytestmark = pytest.mark.slow  # a real server per module

CASES = [
    ("bad JSON", "/v1/completions", b"{not json", 400, "not valid JSON"),
    ("wrong type", "/v1/completions", {"prompt": "hi", "max_tokens": "many"}, 400, "max_tokens"),
    ("missing prompt", "/v1/completions", {"max_tokens": 3}, 400, "prompt"),
    (
        "unknown model",
        "/v1/completions",
        {"model": "gpt-9", "prompt": "hi"},
        404,
        "The model `gpt-9` does not exist.",
    ),
    ("empty cache_salt", "/v1/completions", {"prompt": "hi", "cache_salt": ""}, 400, "cache_salt"),
    (
        "stream_options without stream",
        "/v1/completions",
        {"prompt": "hi", "stream_options": {"include_usage": True}},
        400,
        "stream_options can only be set when stream is true",
    ),
    (
        "prompt longer than context",
        "/v1/completions",
        {"prompt": [5] * 600},
        400,
        "the prompt has 600 tokens, but the context is 512 tokens",
    ),
    (
        "max_tokens < 1",
        "/v1/completions",
        {"prompt": "hi", "max_tokens": 0},
        400,
        "max_tokens must be at least 1",
    ),
    ("priority under fcfs", "/v1/completions", {"prompt": "hi", "priority": 3}, 400, "priority"),
    ("token id out of range", "/v1/completions", {"prompt": [1, 99999]}, 400, "out of range"),
    ("seed past the generator", "/v1/completions", {"prompt": "hi", "seed": 2**64}, 400, "seed"),
    (
        "seed + sample index past the generator",
        "/v1/completions",
        {"prompt": "hi", "seed": 2**64 - 1, "n": 2},
        400,
        "for n=2",
    ),
    (
        "top_k past the vocabulary",
        "/v1/completions",
        {"prompt": "hi", "top_k": 2**63},
        400,
        "top_k",
    ),
    (
        "stop token id past the vocabulary",
        "/v1/completions",
        {"prompt": "hi", "stop_token_ids": [10**9], "min_tokens": 1},
        400,
        "stop token id 1000000000 is out of range",
    ),
    (
        "NaN temperature",
        "/v1/completions",
        b'{"prompt": "hi", "temperature": NaN}',  # Python's JSON reader takes NaN
        400,
        "temperature must be a finite number",
    ),
    (
        "infinite repetition penalty",
        "/v1/completions",
        b'{"prompt": "hi", "repetition_penalty": Infinity}',
        400,
        "repetition_penalty must be a finite number",
    ),
    (
        "n above --max-n",
        "/v1/completions",
        {"prompt": "hi", "n": 129},
        400,
        "n must be at most 128",
    ),
    (
        "prompt + max_tokens past the context",
        "/v1/completions",
        {"prompt": [5] * 500, "max_tokens": 100},
        400,
        "the context is 512 tokens, but 500 prompt tokens and max_tokens 100 ask for 600",
    ),
    (
        "max_tokens 10**9",
        "/v1/completions",
        {"prompt": "hi", "max_tokens": 10**9},
        400,
        "max_tokens 1000000000 ask for",
    ),
    ("n 1000", "/v1/completions", {"prompt": "hi", "n": 1000}, 400, "n must be at most 128"),
    (
        "1 MiB text to /tokenize",
        "/tokenize",
        {"prompt": "y" * (1 << 20)},
        400,
        "bytes of UTF-8, so at least",
    ),
    (
        "1 MiB chat message",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "y" * (1 << 20)}]},
        400,
        "bytes of UTF-8, so at least",
    ),
    ("a string for an integer", "/v1/completions", {"prompt": "hi", "n": "2"}, 400, "n"),
    (
        "a float for an integer",
        "/v1/completions",
        {"prompt": "hi", "max_tokens": 16.0},
        400,
        "max_tokens",
    ),
    ("a boolean token id", "/detokenize", {"tokens": [True]}, 400, "tokens.0"),
    (
        "a string for a boolean",
        "/tokenize",
        {"prompt": "hi", "add_special_tokens": "yes"},
        400,
        "add_special_tokens",
    ),
    ("empty messages", "/v1/chat/completions", {"messages": []}, 400, "messages"),
    (
        "lone surrogate in a prompt",
        "/v1/completions",
        b'{"prompt": "abc \\ud800 def"}',
        400,
        "text is not valid Unicode: surrogates not allowed",
    ),
    (
        "lone surrogate in a chat message",
        "/v1/chat/completions",
        b'{"messages": [{"role": "user", "content": "abc \\ud800 def"}]}',
        400,
        "text is not valid Unicode",
    ),
    (
        "lone surrogate in a content part",
        "/v1/chat/completions",
        b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud800"}]}]}',
        400,
        "text is not valid Unicode",
    ),
    (
        "lone surrogate to /tokenize",
        "/tokenize",
        b'{"prompt": "abc \\ud800 def"}',
        400,
        "text is not valid Unicode",
    ),
    ("empty messages to /tokenize", "/tokenize", {"messages": []}, 400, "messages"),
    (
        "bad role",
        "/v1/chat/completions",
        {"messages": [{"role": "wizard", "content": "x"}]},
        400,
        "role",
    ),
    (
        "temperature < 0",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "temperature": -1},
        400,
        "temperature",
    ),
]


@pytest.mark.parametrize(
    ("name", "path", "body", "status", "message"), CASES, ids=[c[0] for c in CASES]
)
def test_error_status_and_shape(
    server: ServerProcess, name: str, path: str, body: object, status: int, message: str
) -> None:
    """Each bad request gets its status and {"error": {message, type, param, code}}."""
    if isinstance(body, bytes):
        response = httpx.post(
            f"{server.url}{path}", content=body, headers={"content-type": "application/json"}
        )
    else:
        response = httpx.post(f"{server.url}{path}", json=body)
    assert response.status_code == status
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == status
    assert message in error["message"]
    assert "Value error" not in error["message"]  # our words, not the library's prefix
    # ... and the server keeps serving.
    ok = httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi", "max_tokens": 1})
    assert ok.status_code == 200


@pytest.mark.parametrize(
    ("body", "param"),
    [({"cache_salt": ""}, "cache_salt"), ({"priority": 2}, "priority"), ({"prompt": []}, "prompt")],
)
def test_the_param_names_the_field_at_fault(server: ServerProcess, body: dict, param: str) -> None:
    """A refused field is named in `param`, as OpenAI does."""
    response = httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi", **body})
    assert (response.status_code, response.json()["error"]["param"]) == (400, param)


def test_a_wrong_method_is_405_with_allow(server: ServerProcess) -> None:
    """GET on a POST route: 405 in OpenAI's shape, and the Allow header says what works."""
    response = httpx.get(f"{server.url}/v1/completions")
    assert (response.status_code, response.headers["allow"]) == (405, "POST")
    assert response.json()["error"]["code"] == 405


def test_the_schema_documents_400_not_422(server: ServerProcess) -> None:
    """The OpenAPI document promises what the server does: 400 for a malformed body (never
    422) with the error shape, and an empty body from /health."""
    schema = httpx.get(f"{server.url}/openapi.json").json()
    assert '"422"' not in json.dumps(schema) and "HTTPValidationError" not in json.dumps(schema)
    completions = schema["paths"]["/v1/completions"]["post"]["responses"]
    error = completions["400"]["content"]["application/json"]["schema"]
    assert error["properties"]["error"]["required"] == ["message", "type", "param", "code"]
    health = schema["paths"]["/health"]["get"]["responses"]
    assert (health["200"].get("content"), health["503"].get("content")) == ({}, {})


def test_a_body_over_the_limit_is_413_before_it_is_read(server: ServerProcess) -> None:
    """9 MiB against the 8 MiB default: 413 in OpenAI's shape, whether the length is declared
    or the body streams in chunks, in a prompt or in a field nobody reads; the server then
    serves the next request."""
    big = b'{"prompt": "' + b"x" * (9 << 20) + b'"}'
    unknown_field = b'{"prompt": "hi", "junk": "' + b"x" * (9 << 20) + b'"}'

    def chunks() -> Iterator[bytes]:
        for start in range(0, len(big), 1 << 20):
            yield big[start : start + (1 << 20)]

    for content in (big, chunks(), unknown_field):
        response = httpx.post(
            f"{server.url}/v1/completions",
            content=content,
            headers={"content-type": "application/json"},
        )
        assert response.status_code == 413
        assert response.json()["error"]["message"] == (
            f"the request body exceeds {8 << 20} bytes (--max-request-body-bytes)"
        )
    ok = httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi", "max_tokens": 1})
    assert ok.status_code == 200


def test_text_too_long_for_the_context_is_refused_before_tokenizing(server: ServerProcess) -> None:
    """A 1 MiB text prompt (under the body limit) cannot fit 512 tokens: a 400 that counts
    characters, not tokens."""
    response = httpx.post(f"{server.url}/v1/completions", json={"prompt": "y" * (1 << 20)})
    assert response.status_code == 400
    assert "bytes of UTF-8, so at least" in response.json()["error"]["message"]
