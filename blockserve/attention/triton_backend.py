"""The triton attention backend: one launch writes K/V, one launch attends the whole batch."""

from __future__ import annotations

import torch
import triton

from blockserve.attention.metadata import AttentionMetadata
from blockserve.attention.triton_kernels import (
    merge_splits_kernel,
    reshape_and_cache_kernel,
    unified_attention_kernel,
)
from blockserve.attention.triton_plan import (
    DECODE_CONFIG,
    MAX_SPLITS,
    MIN_BLOCK_M,
    KernelConfig,
    TritonAttentionPlan,
    kernel_config,
)


def packed_rows(x: torch.Tensor) -> torch.Tensor:
    """`x` ([tokens, heads, dim]) as it is when each token's heads lie packed in one row (a
    view of the step's fused qkv does), which the K/V write reads with the row stride; else a
    packed copy. Saves two copies per layer."""
    if x.stride(2) == 1 and x.stride(1) == x.shape[2]:
        return x
    return x.contiguous()


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
    num_splits: int | None = None,  # None: chosen for the device
    config: KernelConfig | None = None,  # None: the default for the step's tile height
) -> None:
    """Attend every query over its sequence's paged context (K/V already written)."""
    num_tokens, num_heads, head_dim = query.shape
    key_cache, value_cache = kv_cache[0], kv_cache[1]
    num_kv_heads = key_cache.shape[2]
    queries_per_kv = num_heads // num_kv_heads
    shape = plan.launch_shape(queries_per_kv, num_kv_heads, num_splits)
    metadata = plan.metadata
    splits = shape.num_splits
    config = config or kernel_config(shape.block_m)
    partial, partial_max, partial_sum = plan.split_scratch(
        splits, num_heads, head_dim, query.device
    )
    grid = (shape.tile_seq.numel(), num_kv_heads, splits)
    unified_attention_kernel[grid](
        out,
        partial,
        partial_max,
        partial_sum,
        query,
        key_cache,
        value_cache,
        metadata.block_tables,
        metadata.seq_lens,
        metadata.query_start_loc,
        shape.tile_seq,
        shape.tile_offset,
        head_dim**-0.5,
        num_tokens,
        num_heads,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        metadata.block_tables.stride(0),
        QUERIES_PER_KV=queries_per_kv,
        BLOCK_SIZE=key_cache.shape[1],
        HEAD_DIM=head_dim,
        BLOCK_Q=shape.block_q,
        BLOCK_M=shape.block_m,
        TILE_N=config.tile_n,
        NUM_SPLITS=splits,
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    if splits > 1:
        _merge_splits(out, (partial, partial_max, partial_sum), splits)


def _merge_splits(
    out: torch.Tensor,  # [num_tokens, heads, head_dim], written in place
    scratch: tuple[torch.Tensor, torch.Tensor, torch.Tensor],  # per-split outputs, max, sum
    num_splits: int,
) -> None:
    """Combine the per-split partial softmaxes into `out`."""
    num_tokens, num_heads, head_dim = out.shape
    merge_splits_kernel[(num_tokens, num_heads)](
        out,
        *scratch,
        num_tokens,
        num_heads,
        out.stride(0),
        out.stride(1),
        HEAD_DIM=head_dim,
        NUM_SPLITS=num_splits,
    )


class TritonAttentionBackend:
    """Per step, `prepare` keeps the metadata; the launch shape (how query tokens are tiled, how
    many KV splits) depends on the model's head grouping too, so it is worked out on the first
    layer's call and reused by every other layer of the step. Matches the torch backend
    (tests/attention/test_triton_backend.py, under TRITON_INTERPRET=1 on the CPU).
    """

    name = "triton"

    def forget_kv(self) -> None:
        """Nothing is kept between steps."""

    def prepare(self, metadata: AttentionMetadata) -> TritonAttentionPlan:
        return TritonAttentionPlan(metadata)

    def prepare_decode_graph(
        self, metadata: AttentionMetadata, num_heads: int, num_kv_heads: int, head_dim: int
    ) -> TritonAttentionPlan:
        """A plan a CUDA graph can hold: one query per sequence, every launch shape and
        scratch made now (a capture must not allocate from the host), and the KV splits
        chosen for the longest context `metadata.seq_lens_cpu` names (splits past a shorter
        context attend nothing and the merge gives them no weight)."""
        plan = TritonAttentionPlan(metadata)
        queries_per_kv = num_heads // num_kv_heads
        shape = plan.launch_shape(queries_per_kv, num_kv_heads)
        plan.split_scratch(shape.num_splits, num_heads, head_dim, metadata.slot_mapping.device)
        return plan

    def warm_up(self, kv_cache: torch.Tensor, num_heads: int, max_model_len: int) -> int:
        """Compile now each attention variant a step can launch: decode and prefill tiles,
        times every KV split count a context of `max_model_len` can choose; the launches read
        the null block and their outputs are dropped. Returns how many launches it made."""
        num_kv_heads, head_dim = kv_cache.shape[3], kv_cache.shape[4]
        most = min(MAX_SPLITS, max(1, max_model_len // (2 * DECODE_CONFIG.tile_n)))
        split_counts = [1 << i for i in range(most.bit_length())]
        device = kv_cache.device
        launches = 0
        for query_len in (1, max(MIN_BLOCK_M, num_heads // num_kv_heads) + 1):  # both tiles
            blocks = -(-query_len // kv_cache.shape[2])
            metadata = AttentionMetadata(
                slot_mapping=torch.zeros(query_len, dtype=torch.int64, device=device),
                block_tables=torch.zeros(1, blocks, dtype=torch.int64, device=device),
                query_start_loc=torch.tensor([0, query_len], device=device),
                seq_lens=torch.tensor([query_len], device=device),
                query_lens_cpu=(query_len,),
                seq_lens_cpu=(query_len,),
                block_size=kv_cache.shape[2],
            )
            query = torch.zeros(query_len, num_heads, head_dim, dtype=kv_cache.dtype, device=device)
            plan = TritonAttentionPlan(metadata)
            for num_splits in split_counts:
                unified_attention(query, kv_cache, plan, torch.empty_like(query), num_splits)
                launches += 1
        return launches

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        plan: TritonAttentionPlan,
    ) -> torch.Tensor:
        reshape_and_cache(
            packed_rows(key), packed_rows(value), kv_cache, plan.metadata.slot_mapping
        )
        out = torch.empty_like(query)
        unified_attention(query, kv_cache, plan, out)
        return out
