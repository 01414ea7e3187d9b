"""The triton attention backend: one launch writes K/V, one launch attends the whole batch.

The plan is built once per step: the query tiles (sequence, first query) of at most BLOCK_M
tokens each, so the kernel needs no search to find its sequence. Matches the torch backend
(tests/attention/test_triton_backend.py, under TRITON_INTERPRET=1 on the CPU).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from blockserve.attention.metadata import AttentionMetadata
from blockserve.attention.triton_kernels import reshape_and_cache_kernel, unified_attention_kernel

BLOCK_M = 16  # query tokens per program (tl.dot needs at least 16)


@dataclass(frozen=True, slots=True)
class TritonAttentionPlan:
    metadata: AttentionMetadata
    tile_seq: torch.Tensor  # [num_tiles] int32
    tile_offset: torch.Tensor  # [num_tiles] int32


def reshape_and_cache(
    key: torch.Tensor,  # [num_tokens, kv_heads, head_dim]
    value: torch.Tensor,
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens]
) -> None:
    """Write each token's K/V at its slot."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    key_cache, value_cache = kv_cache[0], kv_cache[1]
    row = num_kv_heads * head_dim
    reshape_and_cache_kernel[(num_tokens,)](
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        key.stride(0),
        value.stride(0),
        key_cache.stride(0),
        key_cache.stride(1),
        BLOCK_SIZE=kv_cache.shape[2],
        ROW=row,
        ROW_POW2=triton.next_power_of_2(row),
    )


def unified_attention(
    query: torch.Tensor,  # [num_tokens, heads, head_dim]
    kv_cache: torch.Tensor,
    plan: TritonAttentionPlan,
    out: torch.Tensor,  # [num_tokens, heads, head_dim], written in place
) -> None:
    """Attend every query over its sequence's paged context (K/V already written)."""
    num_heads, head_dim = query.shape[1], query.shape[2]
    key_cache, value_cache = kv_cache[0], kv_cache[1]
    metadata = plan.metadata
    grid = (plan.tile_seq.numel(), num_heads)
    unified_attention_kernel[grid](
        out,
        query,
        key_cache,
        value_cache,
        metadata.block_tables,
        metadata.seq_lens,
        metadata.query_start_loc,
        plan.tile_seq,
        plan.tile_offset,
        head_dim**-0.5,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        metadata.block_tables.stride(0),
        QUERIES_PER_KV=num_heads // key_cache.shape[2],
        BLOCK_SIZE=key_cache.shape[1],
        HEAD_DIM=head_dim,
        BLOCK_M=BLOCK_M,
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
    )


class TritonAttentionBackend:
    name = "triton"

    def prepare(self, metadata: AttentionMetadata) -> TritonAttentionPlan:
        tile_seq, tile_offset = [], []
        for seq, query_len in enumerate(metadata.query_lens_cpu):
            for first in range(0, query_len, BLOCK_M):
                tile_seq.append(seq)
                tile_offset.append(first)
        device = metadata.slot_mapping.device
        return TritonAttentionPlan(
            metadata,
            torch.tensor(tile_seq, dtype=torch.int32, device=device),
            torch.tensor(tile_offset, dtype=torch.int32, device=device),
        )

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        plan: TritonAttentionPlan,
    ) -> torch.Tensor:
        reshape_and_cache(
            key.contiguous(), value.contiguous(), kv_cache, plan.metadata.slot_mapping
        )
        out = torch.empty_like(query)
        unified_attention(query, kv_cache, plan, out)
        return out
