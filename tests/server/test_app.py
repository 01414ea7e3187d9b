"""The app's own routes against a real server: models, tokenize, health, version, the KV
cache report, and API-key auth on /v1/* only."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.server.conftest import tiny_server
from tests.server.server_process import ServerProcess


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def test_models_lists_the_served_model(client: openai.OpenAI) -> None:
    """/v1/models names the model directory."""
    (model,) = client.models.list().data
    assert model.id.startswith("tiny-llama")


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


def test_debug_kv_cache_reports_a_sound_idle_pool(server: ServerProcess) -> None:
    """Between requests: 256 blocks, none held, usage 0, no integrity error."""
    httpx.post(f"{server.url}/v1/completions", json={"prompt": list(range(40)), "max_tokens": 2})
    report = httpx.get(f"{server.url}/debug/kv_cache").json()
    assert report["num_blocks"] == 256 and report["num_cached_hashes"] >= 2
    assert (report["num_requests_holding_blocks"], report["usage"]) == (0, 0.0)
    assert report["integrity_errors"] == []


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
