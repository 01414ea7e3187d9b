"""A real server with API keys (two flags; BLOCKSERVE_API_KEY ignored), per-key salts and
--response-role: every route but /health needs a key, tenants never share blocks, and the
reply's role follows vLLM's rule."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from blockserve.bench.server_process import ServerProcess
from tests.server.conftest import tiny_server

pytestmark = pytest.mark.slow  # a real server per module


@pytest.fixture(scope="module")
def server_with_keys(
    tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    """Two API keys (one from BLOCKSERVE_API_KEY would be ignored: flags win), per-key salts,
    and --response-role."""
    yield from tiny_server(
        tiny_llama_dir,
        tmp_path_factory,
        [
            "--api-key",
            "sekret",
            "--api-key",
            "second",
            "--cache-salt-per-key",
            "--response-role",
            "helper",
        ],
        env={"BLOCKSERVE_API_KEY": "ignored"},
    )


def test_with_keys_only_health_answers_without_one(server_with_keys: ServerProcess) -> None:
    """Every route but /health is 401 without a key (metrics, docs and schema included); a
    wrong key is 401 too; each configured key works."""
    url = server_with_keys.url
    for method, path in [
        ("POST", "/v1/completions"),
        ("GET", "/v1/models"),
        ("POST", "/tokenize"),
        ("POST", "/detokenize"),
        ("GET", "/metrics"),
        ("GET", "/version"),
        ("GET", "/openapi.json"),
        ("GET", "/docs"),
        ("GET", "/redoc"),
        ("GET", "/debug/kv_cache"),
        ("GET", "/debug/miss_ratio_curve"),
    ]:
        response = httpx.request(method, f"{url}{path}", json={})
        assert (path, response.status_code) == (path, 401)
    assert httpx.get(f"{url}/health").status_code == 200
    for key in ("sekret", "second"):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)
        assert client.completions.create(model=None, prompt="hi", max_tokens=1).choices  # type: ignore[arg-type]
    for key in ("nope", "ignored"):
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0).models.list()


def test_per_key_salts_keep_tenants_apart(server_with_keys: ServerProcess) -> None:
    """The same 40-token prompt: a tenant's second request hits 32 tokens, the other
    tenant's first hits none."""
    url, prompt = server_with_keys.url, list(range(200, 240))

    def cached(key: str) -> int:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)
        usage = client.completions.create(model=None, prompt=prompt, max_tokens=1).usage  # type: ignore[arg-type]
        assert usage is not None and usage.prompt_tokens_details is not None
        return int(usage.prompt_tokens_details.cached_tokens or 0)

    assert [cached("sekret"), cached("sekret"), cached("second")] == [0, 32, 0]


def test_response_role(server_with_keys: ServerProcess) -> None:
    """--response-role names the reply's role (streamed and not) when the generation prompt
    is added; without it the reply continues the last message, in its role (vLLM's rule)."""
    client = openai.OpenAI(base_url=f"{server_with_keys.url}/v1", api_key="sekret", max_retries=0)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]

    def roles(**extra: object) -> tuple[str, str | None]:
        reply = client.chat.completions.create(
            model=None,
            messages=messages,
            max_tokens=2,
            extra_body=extra,  # type: ignore[arg-type]
        )
        stream = client.chat.completions.create(
            model=None, messages=messages, max_tokens=2, stream=True,  # type: ignore[arg-type]
            extra_body=extra,
        )  # fmt: skip
        return reply.choices[0].message.role, next(iter(stream)).choices[0].delta.role

    assert roles() == ("helper", "helper")
    assert roles(add_generation_prompt=False) == ("user", "user")
