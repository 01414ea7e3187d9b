"""How the triton attention kernel is launched for a step: launch configurations per shape
class, the tiling of queries into programs, the KV splits, and the step's plan that keeps them
for every layer."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import torch
import triton

from blockserve.attention.metadata import AttentionMetadata

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
