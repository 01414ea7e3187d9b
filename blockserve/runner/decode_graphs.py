"""CUDA graphs for decode steps: a decode batch's whole forward replayed as one graph, at the
bucketed batch sizes captured at start-up; inputs are copied into static buffers and the rows
past the batch padded. Prefills, and batches above the largest bucket, run eagerly."""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from blockserve.attention.metadata import AttentionMetadata
from blockserve.runner.inputs import ModelInputs

Forward = Callable[[torch.Tensor, torch.Tensor, list[torch.Tensor], Any], torch.Tensor]


def graph_batch_sizes(max_num_seqs: int, sizes: tuple[int, ...] = ()) -> tuple[int, ...]:
    """The batch sizes to capture: `sizes` if given, else vLLM's 1, 2, 4 and every multiple
    of 8; those above `max_num_seqs` dropped."""
    chosen = sizes or (1, 2, 4, *range(8, max_num_seqs + 1, 8))
    return tuple(sorted({size for size in chosen if 0 < size <= max_num_seqs}))


def bucket_for(num_seqs: int, sizes: tuple[int, ...]) -> int | None:
    """The smallest captured size that holds `num_seqs` rows; None above the largest."""
    index = bisect.bisect_left(sizes, num_seqs)
    return sizes[index] if index < len(sizes) else None


class StaticDecodeInputs:
    """A decode batch's inputs at fixed addresses, sized for the largest bucket. Rows past the
    batch are padding: token 0 at position 0 with one key, written to slot 0 (the null block,
    which no sequence's attention reads) and attending over that slot alone."""

    def __init__(
        self, max_batch: int, max_blocks: int, block_size: int, device: torch.device
    ) -> None:
        def ints(*shape: int) -> torch.Tensor:
            return torch.zeros(*shape, dtype=torch.int64, device=device)

        self.block_size = block_size
        self.input_ids = ints(max_batch)
        self.positions = ints(max_batch)
        self.slot_mapping = ints(max_batch)
        self.block_tables = ints(max_batch, max_blocks)
        self.seq_lens = ints(max_batch).fill_(1)
        self.query_start_loc = torch.arange(max_batch + 1, device=device)  # a token a row

    @property
    def max_blocks(self) -> int:
        return self.block_tables.shape[1]

    def load(self, inputs: ModelInputs, bucket: int) -> None:
        """Copy a decode step's `num_seqs` rows in and pad the rest of `bucket`."""
        metadata = inputs.metadata
        rows, width = metadata.block_tables.shape
        self.input_ids[:rows].copy_(inputs.input_ids, non_blocking=True)
        self.positions[:rows].copy_(inputs.positions, non_blocking=True)
        self.slot_mapping[:rows].copy_(metadata.slot_mapping, non_blocking=True)
        self.block_tables[:rows, :width].copy_(metadata.block_tables, non_blocking=True)
        self.seq_lens[:rows].copy_(metadata.seq_lens, non_blocking=True)
        for padding in (self.input_ids, self.positions, self.slot_mapping):
            padding[rows:bucket].zero_()
        self.block_tables[rows:bucket].zero_()
        self.seq_lens[rows:bucket].fill_(1)

    def metadata(self, bucket: int) -> AttentionMetadata:
        """The first `bucket` rows as attention metadata; the host-side lengths say one token
        per row and the longest context a row can have (what a capture must plan for)."""
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:bucket],
            block_tables=self.block_tables[:bucket],
            query_start_loc=self.query_start_loc[: bucket + 1],
            seq_lens=self.seq_lens[:bucket],
            query_lens_cpu=(1,) * bucket,
            seq_lens_cpu=(self.max_blocks * self.block_size,) * bucket,
            block_size=self.block_size,
        )


class GraphCapture(Protocol):
    """Records `run` once, returning what replays it: a CUDA graph, or `run` itself."""

    def capture(self, run: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]: ...

    def memory_bytes(self) -> int:
        """Device memory the captures hold."""


class CudaGraphCapture:
    """CUDA graphs sharing one memory pool; each capture is preceded by an eager run of the
    same shapes (Triton compiles there, outside the graph)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()
        self._reserved_before = torch.cuda.memory_reserved(device)

    def capture(self, run: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        run()
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            output = run()

        def replay() -> torch.Tensor:
            graph.replay()
            return output

        return replay

    def memory_bytes(self) -> int:
        return torch.cuda.memory_reserved(self.device) - self._reserved_before


class EagerCapture:
    """Replays by running again over the same static buffers: the graphs' inputs, padding and
    plans without CUDA (tests on the CPU)."""

    def capture(self, run: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        run()
        return run

    def memory_bytes(self) -> int:
        return 0


@runtime_checkable
class GraphPlanner(Protocol):
    """A backend whose decode attention a graph can hold: its plan reads only device tensors
    and launches the same kernels, however long the contexts are."""

    def prepare_decode_graph(
        self, metadata: AttentionMetadata, num_heads: int, num_kv_heads: int, head_dim: int
    ) -> Any: ...


@runtime_checkable
class KernelWarmUp(Protocol):
    """A backend that can compile, before the engine is ready, every kernel variant its steps
    can launch in a context of up to `max_model_len` tokens."""

    def warm_up(self, kv_cache: torch.Tensor, num_heads: int, max_model_len: int) -> int: ...


@dataclass(frozen=True, slots=True)
class GraphReport:
    """What the start-up log says of the captured graphs."""

    sizes: tuple[int, ...]
    seconds: float
    memory_bytes: int

    def line(self) -> str:
        return (
            f"captured {len(self.sizes)} CUDA graphs for decode batches of "
            f"{self.sizes[0]}..{self.sizes[-1]} sequences in {self.seconds:.1f} s, "
            f"{self.memory_bytes / (1 << 20):.0f} MiB"
        )


class DecodeGraphs:
    """One replayable forward per bucket over `StaticDecodeInputs`; `run` takes a step's
    inputs and returns its hidden states, or None when the step is not one a graph holds
    (any prefill, more rows than the largest bucket, a wider block table)."""

    def __init__(self, inputs: StaticDecodeInputs, sizes: tuple[int, ...]) -> None:
        self.inputs = inputs
        self.sizes = sizes
        self.replays: dict[int, Callable[[], torch.Tensor]] = {}

    def capture_all(
        self,
        forward: Forward,
        kv_caches: list[torch.Tensor],
        planner: GraphPlanner,
        heads: tuple[int, int, int],  # num_heads, num_kv_heads, head_dim
        capture: GraphCapture,
    ) -> GraphReport:
        """Capture every bucket, largest first (the smaller ones reuse its memory)."""
        start = time.perf_counter()
        for bucket in sorted(self.sizes, reverse=True):
            plan = planner.prepare_decode_graph(self.inputs.metadata(bucket), *heads)
            ids, positions = self.inputs.input_ids[:bucket], self.inputs.positions[:bucket]

            def run(
                ids: torch.Tensor = ids, positions: torch.Tensor = positions, plan: Any = plan
            ) -> torch.Tensor:
                return forward(ids, positions, kv_caches, plan)

            self.replays[bucket] = capture.capture(run)
        seconds = time.perf_counter() - start
        return GraphReport(self.sizes, seconds, capture.memory_bytes())

    def run(self, inputs: ModelInputs) -> torch.Tensor | None:
        metadata = inputs.metadata
        rows = metadata.num_seqs
        if metadata.num_tokens != rows or metadata.block_tables.shape[1] > self.inputs.max_blocks:
            return None
        bucket = bucket_for(rows, self.sizes)
        if bucket is None:
            return None
        self.inputs.load(inputs, bucket)
        return self.replays[bucket]()
