"""The triton attention backend: one launch writes K/V, one launch attends the whole batch."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import torch
import triton

from blockserve.attention.metadata import AttentionMetadata
from blockserve.attention.triton_kernels import (
    merge_splits_kernel,
    reshape_and_cache_kernel,
    unified_attention_kernel,
)

MIN_BLOCK_M = 16  # tl.dot's smallest tile
PREFILL_BLOCK_M = 64  # rows per program when some sequence brings more than a few tokens
MAX_SPLITS = 32


@dataclass(frozen=True, slots=True)
class KernelConfig:
    """Launch parameters of the attention kernel: the best of `bench_attention.py --sweep` on
    an H200 for each shape class (docs/benchmarks/gpu.md; gpu_check.sh re-runs the sweep). CI
    compiles these for sm_90 and checks they pipeline the K/V loads without register spills."""

    tile_n: int  # keys per loop iteration (64: four 16-token blocks)
    num_warps: int
    num_stages: int  # software pipelining depth of the K/V loads


DECODE_CONFIG = KernelConfig(tile_n=64, num_warps=4, num_stages=2)
PREFILL_CONFIG = KernelConfig(tile_n=64, num_warps=4, num_stages=2)


def kernel_config(block_m: int) -> KernelConfig:
    return DECODE_CONFIG if block_m <= MIN_BLOCK_M else PREFILL_CONFIG


@dataclass(frozen=True, slots=True)
class LaunchShape:
    """How one step's queries are cut into programs."""

    block_m: int  # rows per program: block_q tokens x queries_per_kv heads, padded to pow2
    block_q: int  # query tokens per tile
    tile_seq: torch.Tensor  # [num_tiles] int32: the sequence of each tile
    tile_offset: torch.Tensor  # [num_tiles] int32: its first query within the sequence
    num_splits: int  # KV splits per program (a power of two); 1 = no merge step


SplitScratch = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # partial out, max, sum


@dataclass(slots=True)
class TritonAttentionPlan:
    """One step's plan: the metadata, plus what the first layer works out and every later
    layer reuses (launch shapes; the float32 scratch of split launches, safe to share because
    layers run in stream order: a layer's merge has read it before the next layer writes)."""

    metadata: AttentionMetadata
    shapes: dict[tuple[int, int, int | None], LaunchShape] = field(default_factory=dict)
    scratch: dict[tuple[int, int, int], SplitScratch] = field(default_factory=dict)

    def launch_shape(
        self, queries_per_kv: int, num_kv_heads: int, num_splits: int | None = None
    ) -> LaunchShape:
        """The step's tiling for this head grouping (computed once, then reused)."""
        key = (queries_per_kv, num_kv_heads, num_splits)
        if key not in self.shapes:
            self.shapes[key] = plan_launch(self.metadata, queries_per_kv, num_kv_heads, num_splits)
        return self.shapes[key]

    def split_scratch(
        self, num_splits: int, num_heads: int, head_dim: int, device: torch.device
    ) -> SplitScratch:
        """[splits, tokens, heads, head_dim], [splits, tokens, heads] x 2, float32; for an
        unsplit launch, which never touches them, one-element stand-ins."""
        key = (num_splits, num_heads, head_dim)
        if key not in self.scratch:
            if num_splits == 1:
                stand_in = torch.empty(1, dtype=torch.float32, device=device)
                self.scratch[key] = (stand_in, stand_in, stand_in)
            else:
                stats = (num_splits, self.metadata.num_tokens, num_heads)
                self.scratch[key] = (
                    torch.empty(*stats, head_dim, dtype=torch.float32, device=device),
                    torch.empty(stats, dtype=torch.float32, device=device),
                    torch.empty(stats, dtype=torch.float32, device=device),
                )
        return self.scratch[key]


@functools.cache
def multiprocessor_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def choose_num_splits(
    num_programs: int, max_seq_len: int, tile_n: int, multiprocessors: int
) -> int:
    """Split the keys only when the programs would leave most of the device idle: aim for two
    programs per multiprocessor, each split keeping at least two key tiles."""
    wanted = math.ceil(2 * multiprocessors / max(1, num_programs))
    most = min(MAX_SPLITS, wanted, max(1, max_seq_len // (2 * tile_n)))
    return 1 << (most.bit_length() - 1)  # the largest power of two <= most


def plan_launch(
    metadata: AttentionMetadata,
    queries_per_kv: int,
    num_kv_heads: int,
    num_splits: int | None = None,
) -> LaunchShape:
    """Tile each sequence's queries so that a program's rows (tokens x grouped heads) fill a
    tensor-core tile; choose the KV splits unless given."""
    smallest = max(MIN_BLOCK_M, triton.next_power_of_2(queries_per_kv))
    longest_query = max(metadata.query_lens_cpu, default=1)
    block_m = smallest
    if longest_query * queries_per_kv > smallest:
        block_m = max(PREFILL_BLOCK_M, smallest)
    block_q = block_m // queries_per_kv
    tile_seq, tile_offset = [], []
    for seq, query_len in enumerate(metadata.query_lens_cpu):
        for first in range(0, query_len, block_q):
            tile_seq.append(seq)
            tile_offset.append(first)
    device = metadata.slot_mapping.device
    if num_splits is None:
        num_splits = 1  # the interpreter (CPU) gains nothing from splits
        if device.type == "cuda":
            num_splits = choose_num_splits(
                len(tile_seq) * num_kv_heads,
                max(metadata.seq_lens_cpu, default=1),
                kernel_config(block_m).tile_n,
                multiprocessor_count(device),
            )
    elif num_splits < 1 or num_splits & (num_splits - 1):
        raise ValueError(f"num_splits must be a power of two, got {num_splits}")
    return LaunchShape(
        block_m=block_m,
        block_q=block_q,
        tile_seq=torch.tensor(tile_seq, dtype=torch.int32, device=device),
        tile_offset=torch.tensor(tile_offset, dtype=torch.int32, device=device),
        num_splits=num_splits,
    )


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
