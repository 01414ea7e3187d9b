"""API keys: which requests must show one, which key a request showed, and the cache salt a key
implies. With keys configured every route but `/health` needs `Authorization: Bearer <key>` (and
`/metrics` too unless it is opened explicitly). Keys are compared in constant time, every key
every time, so the answer's timing says nothing about which key nearly matched."""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
from collections.abc import Mapping, Sequence
from pathlib import Path

from starlette.types import ASGIApp, Receive, Scope, Send

from blockserve.errors import InvalidConfigError
from blockserve.server.errors import error_response
from blockserve.server.options import ServerConfig


def read_api_keys(path: str) -> tuple[str, ...]:
    """The keys in a file, one per line; blank lines and lines starting with # are skipped."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as exc:
        raise InvalidConfigError(f"api_keys_file (--api-keys-file): {exc}") from None
    stripped = (line.strip() for line in lines)
    keys = tuple(line for line in stripped if line and not line.startswith("#"))
    if not keys:
        raise InvalidConfigError(f"api_keys_file (--api-keys-file): no key in {path}")
    return keys


def resolve_api_keys(config: ServerConfig, environ: Mapping[str, str]) -> ServerConfig:
    """The config with every key it names: the flags', the keys file's, or, when neither gives
    one, BLOCKSERVE_API_KEY. A per-key cache salt without any key is a config error."""
    keys = config.api_key
    if config.api_keys_file is not None:
        keys += read_api_keys(config.api_keys_file)
    if not keys and environ.get("BLOCKSERVE_API_KEY"):
        keys = (environ["BLOCKSERVE_API_KEY"],)
    if config.cache_salt_per_key and not keys:
        raise InvalidConfigError(
            "cache_salt_per_key (--cache-salt-per-key) needs an API key (--api-key)"
        )
    return dataclasses.replace(config, api_key=keys)


def describe_access(config: ServerConfig) -> str:
    """Which routes need a key, for the start-up log: a scrape that gets 401s, or an open
    server someone believed closed, is said at start."""
    if not config.api_key:
        return "API keys: none, every route is open (--api-key or BLOCKSERVE_API_KEY requires one)"
    if config.metrics_without_auth:
        return "API keys: required on every route but /health and /metrics (--metrics-without-auth)"
    return (
        "API keys: required on every route but /health; /metrics too (a Prometheus scrape sets "
        "`authorization: {credentials: KEY}`; --metrics-without-auth opens it, as vLLM leaves it)"
    )


class RequireApiKey:
    """ASGI middleware: outside `open_paths` a request needs one of `keys` (else 401); the key
    it showed is left in its state (`request.state.api_key`). Pure ASGI, not Starlette's
    BaseHTTPMiddleware, which would hide a client's disconnect from the handlers."""

    def __init__(self, app: ASGIApp, keys: Sequence[str], open_paths: frozenset[str]) -> None:
        self.app = app
        self.expected = [(key, f"Bearer {key}".encode()) for key in keys]
        self.open_paths = open_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in self.open_paths:
            given = dict(scope["headers"]).get(b"authorization", b"")
            # Every key is compared (no early exit), each in constant time.
            matches = [key for key, value in self.expected if hmac.compare_digest(given, value)]
            if not matches:
                await error_response(401, "invalid or missing API key")(scope, receive, send)
                return
            scope.setdefault("state", {})["api_key"] = matches[0]
        await self.app(scope, receive, send)


def salt_for_key(api_key: str, client_salt: str | None) -> str:
    """The cache salt of a request made with `api_key`: a digest of the key, with the
    client's own salt (if any) namespaced under it. Tenants never share cached blocks."""
    if client_salt == "":
        return client_salt  # left for the request check to refuse, as without keys
    tenant = hashlib.sha256(api_key.encode()).hexdigest()[:32]
    return tenant if client_salt is None else f"{tenant}:{client_salt}"
