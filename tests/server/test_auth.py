"""API keys: where they come from, which routes need them, and the cache salt they imply."""

from __future__ import annotations

from pathlib import Path

import pytest
from fastapi import FastAPI, Request
from fastapi.testclient import TestClient

from blockserve.errors import InvalidConfigError
from blockserve.server.auth import (
    RequireApiKey,
    describe_access,
    read_api_keys,
    resolve_api_keys,
    salt_for_key,
)
from blockserve.server.options import ServerConfig


def test_keys_come_from_flags_and_file_and_else_the_environment(tmp_path: Path) -> None:
    """Flag keys and file keys add up; the environment variable counts only when neither
    gives a key."""
    keys_file = tmp_path / "keys"
    keys_file.write_text("# tenants\nalpha\n\n  beta  \n  # an indented comment\n")
    assert read_api_keys(str(keys_file)) == ("alpha", "beta")
    env = {"BLOCKSERVE_API_KEY": "from-env"}
    both = ServerConfig(api_key=("flag",), api_keys_file=str(keys_file))
    assert resolve_api_keys(both, env).api_key == ("flag", "alpha", "beta")
    assert resolve_api_keys(ServerConfig(), env).api_key == ("from-env",)
    assert resolve_api_keys(ServerConfig(), {}).api_key == ()


def test_bad_key_sources_are_config_errors(tmp_path: Path) -> None:
    """A missing or empty keys file, or per-key salts with no key, stop the server."""
    with pytest.raises(InvalidConfigError, match="api_keys_file"):
        read_api_keys(str(tmp_path / "absent"))
    (tmp_path / "empty").write_text("# nothing\n")
    with pytest.raises(InvalidConfigError, match="no key in"):
        read_api_keys(str(tmp_path / "empty"))
    with pytest.raises(InvalidConfigError, match=r"cache_salt_per_key .* needs an API key"):
        resolve_api_keys(ServerConfig(cache_salt_per_key=True), {})


def test_per_key_salts_separate_tenants_and_keep_client_salts_apart() -> None:
    """Two keys give two salts; a client salt lives under its key's; "" is left to the
    request check to refuse."""
    plain_a, plain_b = salt_for_key("a", None), salt_for_key("b", None)
    assert plain_a != plain_b and len(plain_a) == 32
    assert salt_for_key("a", "s") == f"{plain_a}:s" != salt_for_key("b", "s")
    assert salt_for_key("a", "") == ""


def app_with_keys(open_paths: frozenset[str]) -> TestClient:
    app = FastAPI()
    app.add_middleware(RequireApiKey, keys=("k1", "k2"), open_paths=open_paths)

    @app.get("/health")
    async def health() -> dict:
        return {}

    @app.get("/metrics")
    async def metrics() -> dict:
        return {}

    @app.get("/whoami")
    async def whoami(request: Request) -> dict:
        return {"key": request.state.api_key}

    return TestClient(app)


def test_only_open_paths_answer_without_a_key() -> None:
    """Open paths answer anyone; any other path wants one of the keys, and learns which."""
    client = app_with_keys(frozenset({"/health"}))
    assert client.get("/health").status_code == 200
    assert client.get("/metrics").status_code == 401
    denied = client.get("/whoami", headers={"Authorization": "Bearer k3"})
    assert (denied.status_code, denied.json()["error"]["code"]) == (401, 401)
    assert client.get("/whoami", headers={"Authorization": "Bearer k2"}).json() == {"key": "k2"}
    opened = app_with_keys(frozenset({"/health", "/metrics"}))
    assert opened.get("/metrics").status_code == 200


def test_the_start_says_which_routes_need_a_key() -> None:
    """The log line says, for each setting, whether /metrics needs the key and which flag
    opens it."""
    assert describe_access(ServerConfig()) == (
        "API keys: none, every route is open (--api-key or BLOCKSERVE_API_KEY requires one)"
    )
    assert describe_access(ServerConfig(api_key=("k",))) == (
        "API keys: required on every route but /health; /metrics too (a Prometheus scrape sets "
        "`authorization: {credentials: KEY}`; --metrics-without-auth opens it, as vLLM leaves it)"
    )
    assert describe_access(ServerConfig(api_key=("k",), metrics_without_auth=True)) == (
        "API keys: required on every route but /health and /metrics (--metrics-without-auth)"
    )
