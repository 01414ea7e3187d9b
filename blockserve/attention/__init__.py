"""Attention over the paged KV cache: metadata and backends (torch on CPU; triton, cuda on GPU).

Modules:

  metadata.py        AttentionMetadata, the KV cache layout, the backend protocol
  torch_backend.py   the reference backend (CPU default): batched decodes, the step's plan
  prefill.py         prefills one sequence at a time (torch and cuda backends)
  batch_split.py     a step's sequences by kind: decodes, fresh prefills, chunks on a prefix
  shared_prefix.py   many queries over one shared cached prefix, read once (cascade); a chunk
                     that would pad the others (long, on a short cache) goes alone
  common_blocks.py   that prefix's blocks as our kernel packed them, kept across steps
  triton_kernels.py  Triton: reshape-and-cache, unified paged attention, split merge
  triton_plan.py     how a step launches it: configs per shape class, query tiling, KV splits,
                     the plan every layer of the step shares
  triton_backend.py  the triton backend (CUDA default): the launches; a decode graph's plan
                     (made up front); the start-up warm-up of every kernel variant
  cuda_backend.py    the cuda backend: csrc/ kernels, built on first use
  selector.py        backend choice by name and device
"""

from __future__ import annotations

from blockserve.attention.metadata import AttentionBackend, AttentionMetadata
from blockserve.attention.selector import get_attention_backend

__all__ = ["AttentionBackend", "AttentionMetadata", "get_attention_backend"]
