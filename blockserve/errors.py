"""Typed errors for conditions that callers handle.

Every error a user's input can cause derives from `BlockserveError`; the HTTP server maps each
class to a status code through `http_status`. Internal invariants use `assert`, never these.
"""

from __future__ import annotations


class BlockserveError(Exception):
    """Base class of every error blockserve raises on purpose."""

    http_status = 500


class InvalidConfigError(BlockserveError, ValueError):
    """A configuration value is out of range or of the wrong type."""

    http_status = 400


class UnknownHashAlgorithmError(InvalidConfigError):
    """`--prefix-caching-hash-algo` names no known algorithm."""


class InvalidRequestError(BlockserveError, ValueError):
    """A request (or a call on its behalf) is malformed; nothing was changed. `param` names
    the request field at fault, when one is."""

    http_status = 400

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class NoFreeBlocksError(BlockserveError, RuntimeError):
    """More KV blocks were asked of the pool than it has free; nothing was changed."""

    http_status = 503


class UnsupportedModelError(BlockserveError, ValueError):
    """The model's architecture or one of its settings is not one blockserve can run."""

    http_status = 400


class ModelNotFoundError(BlockserveError, FileNotFoundError):
    """No model at the given path, or the default model package is not installed."""

    http_status = 404


class BackendUnavailableError(BlockserveError, RuntimeError):
    """The chosen attention backend cannot run on this machine."""

    http_status = 500


class EngineDeadError(BlockserveError, RuntimeError):
    """The engine loop has stopped and cannot serve requests."""

    http_status = 503


class ServerShuttingDownError(BlockserveError, RuntimeError):
    """The server is draining before it stops: no new work, and running work past the
    deadline ends with this."""

    http_status = 503


class ServerOverloadedError(BlockserveError, RuntimeError):
    """A queue in front of the engine is full (the tokenizer pool's): try again shortly, as
    the `Retry-After` header of the 503 says."""

    http_status = 503
    retry_after_s = 1


class ClientDisconnectedError(BlockserveError, RuntimeError):
    """The client closed its connection before its answer was ready; its requests were
    aborted. The status is nginx's 499 ("client closed request"): nobody reads it, but the
    access log tells a departed client from a server error."""

    http_status = 499


class RequestFailedError(BlockserveError, RuntimeError):
    """The engine failed while running a request (the engine itself goes on)."""

    http_status = 500
