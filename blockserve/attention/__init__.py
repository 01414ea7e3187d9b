"""Attention over the paged KV cache: metadata and backends (torch on CPU; triton, cuda on GPU)."""

from __future__ import annotations

from blockserve.attention.metadata import AttentionBackend, AttentionMetadata
from blockserve.attention.selector import get_attention_backend

__all__ = ["AttentionBackend", "AttentionMetadata", "get_attention_backend"]
