"""Choosing an attention backend: automatic by device, or by name with a clear error."""

from __future__ import annotations

from blockserve.attention.metadata import AttentionBackend
from blockserve.attention.torch_backend import TorchAttentionBackend
from blockserve.errors import BackendUnavailableError, InvalidConfigError

BACKEND_NAMES = ("auto", "torch")


def get_attention_backend(name: str, device: str) -> AttentionBackend:
    """`auto` picks the torch backend (the only one built so far) on any device."""
    if name not in BACKEND_NAMES:
        raise InvalidConfigError(
            f"unknown attention backend {name!r}; choose one of {', '.join(BACKEND_NAMES)}"
        )
    if name in ("auto", "torch"):
        return TorchAttentionBackend()
    raise BackendUnavailableError(f"attention backend {name!r} cannot run on {device}")
