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
    """A request (or a call on its behalf) is malformed; nothing was changed."""

    http_status = 400


class NoFreeBlocksError(BlockserveError, RuntimeError):
    """More KV blocks were asked of the pool than it has free; nothing was changed."""

    http_status = 503
