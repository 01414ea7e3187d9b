"""Every error case answers its documented status in OpenAI's shape; the server keeps serving."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.server.conftest import tiny_server
from tests.server.server_process import ServerProcess

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
        "stream_options",
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
    ("empty messages", "/v1/chat/completions", {"messages": []}, 400, "messages"),
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
    # ... and the server keeps serving.
    ok = httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi", "max_tokens": 1})
    assert ok.status_code == 200


def test_tokenize_and_detokenize(server: ServerProcess) -> None:
    """/tokenize returns count, max_model_len and tokens; /detokenize inverts it."""
    tokens = httpx.post(f"{server.url}/tokenize", json={"prompt": "hello world"}).json()
    assert tokens["count"] == len(tokens["tokens"]) > 0
    assert tokens["max_model_len"] == 512
    text = httpx.post(f"{server.url}/detokenize", json={"tokens": tokens["tokens"]}).json()
    assert text == {"prompt": "hello world"}
    assert httpx.post(f"{server.url}/detokenize", json={"tokens": [-1]}).status_code == 400


def test_health_version_and_unknown_route(server: ServerProcess) -> None:
    """/health is 200 with an empty body; /version answers; unknown routes are 404 JSON."""
    health = httpx.get(f"{server.url}/health")
    assert (health.status_code, health.content) == (200, b"")
    assert httpx.get(f"{server.url}/version").json()["version"]
    missing = httpx.get(f"{server.url}/v1/nothing")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == 404


@pytest.fixture(scope="module")
def server_with_key(
    tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    yield from tiny_server(tiny_llama_dir, tmp_path_factory, env={"BLOCKSERVE_API_KEY": "sekret"})


def test_api_key_guards_v1_only(server_with_key: ServerProcess) -> None:
    """Without the key /v1/* is 401; /health and /metrics stay open; the key works."""
    url = server_with_key.url
    denied = httpx.post(
        f"{url}/v1/completions",
        json={"prompt": "hi", "max_tokens": 1},
        headers={"Authorization": "Bearer wrong"},
    )
    assert denied.status_code == 401 and denied.json()["error"]["code"] == 401
    assert httpx.get(f"{url}/v1/models").status_code == 401
    assert httpx.get(f"{url}/health").status_code == 200
    assert httpx.get(f"{url}/metrics").status_code == 200
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="sekret", max_retries=0)
    assert client.completions.create(model=None, prompt="hi", max_tokens=1).choices  # type: ignore[arg-type]
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{url}/v1", api_key="nope", max_retries=0).models.list()
