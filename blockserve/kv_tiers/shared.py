"""The shared tier's store, chosen by its URL's scheme (--kv-remote-url): another kind of shared
store is one class of `SharedStore` and one line in `SCHEMES`. Torch-free: the option's check
reads the schemes; a store's module is imported when one opens."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from blockserve.kv_tiers.store import BlockShape, SharedStore

# Scheme -> the module and the class that serve it.
SCHEMES = {
    "redis": ("blockserve.kv_tiers.remote", "RemoteStore"),
    "rediss": ("blockserve.kv_tiers.remote", "RemoteStore"),
    "unix": ("blockserve.kv_tiers.remote", "RemoteStore"),
}


def open_shared_store(
    url: str, shape: BlockShape, namespace: str, secret: bytes | None = None
) -> SharedStore:
    """The store `url` names, its blocks under `namespace` (the cache's fingerprint)."""
    scheme = url.split("://", 1)[0]
    if scheme not in SCHEMES:  # the option's check refuses such URLs first
        raise ValueError(f"no shared KV store serves {scheme}:// URLs")
    module, name = SCHEMES[scheme]
    store: SharedStore = getattr(importlib.import_module(module), name)(
        url, shape, namespace, secret=secret
    )
    return store
