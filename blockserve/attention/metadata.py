"""`AttentionMetadata`: where one step's tokens sit in the paged KV cache. Built once per step by
the runner and passed explicitly to the model (no forward-context globals). Every backend reads
the same fields; each may derive its own plan from them once per step
(`AttentionBackend.prepare`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch


@dataclass(frozen=True, slots=True)
class AttentionMetadata:
    """The flat batch's layout. Sequences appear in batch order; sequence i owns query tokens
    `query_start_loc[i] : query_start_loc[i + 1]`, at absolute positions
    `seq_lens[i] - query_lens[i] ... seq_lens[i] - 1`.

    KV cache layout, per layer (the one place it is defined):

        kv_cache: [2, num_blocks, block_size, num_kv_heads, head_dim]   (0 = keys, 1 = values)

    so `kv_cache[0].view(-1, num_kv_heads, head_dim)[slot]` is the key at `slot`, where `slot =
    block_id * block_size + position % block_size`.
    """

    slot_mapping: torch.Tensor  # [num_tokens] int64: cache slot of each new token's K/V
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int64, padded with block 0
    query_start_loc: torch.Tensor  # [num_seqs + 1] int64
    seq_lens: torch.Tensor  # [num_seqs] int64: context length after this step
    query_lens_cpu: tuple[int, ...]  # host copies, for planning without device syncs
    seq_lens_cpu: tuple[int, ...]
    block_size: int

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return int(sum(self.query_lens_cpu))


class AttentionBackend(Protocol):
    """One attention implementation over the paged cache."""

    name: str

    def prepare(self, metadata: AttentionMetadata) -> Any:
        """Derive this backend's per-step plan (called once per step, before the forward)."""

    def forget_kv(self) -> None:
        """Something outside the forward wrote into the KV caches (the KV tiers' loads, from
        their own thread): drop whatever the backend keeps that was derived from them."""

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        plan: Any,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        """Write this step's K/V into the cache, then attend each query over its context."""
