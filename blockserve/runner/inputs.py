"""A step's flat batch: token ids, positions, slots and block tables, built once per step on
the host in one buffer and copied to the device in one transfer."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch

from blockserve.attention.metadata import AttentionMetadata
from blockserve.sched.output import SchedulerOutput


@dataclass(frozen=True)
class ModelInputs:
    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    metadata: AttentionMetadata
    sample_indices: torch.Tensor  # [num_sampled]: token index whose logits are sampled


def prepare_inputs(
    scheduler_output: SchedulerOutput, block_size: int, device: torch.device
) -> ModelInputs:
    """Flatten the step into token ids, positions, slots and block tables: every int64 array
    is laid out in one host buffer (pinned for CUDA), which goes to the device in one copy
    and is sliced there."""
    scheduled = scheduler_output.scheduled
    rows = len(scheduled)
    query_lens = np.fromiter((len(s.token_ids) for s in scheduled), np.int64, rows)
    num_computed = np.fromiter((s.num_computed_tokens for s in scheduled), np.int64, rows)
    num_tokens = int(query_lens.sum())
    max_blocks = max(len(s.block_ids) for s in scheduled)
    sizes = (num_tokens, num_tokens, num_tokens, rows + 1, rows, rows, rows * max_blocks)
    # Each array starts 16-byte aligned, as a fresh tensor would (Triton specializes on it).
    spans = [size + size % 2 for size in sizes]
    offsets = list(itertools.accumulate(spans, initial=0))
    host = torch.empty(offsets[-1], dtype=torch.int64, pin_memory=device.type == "cuda")
    flat = host.numpy()
    ids, positions, slots, starts, seq_lens, samples, tables = (
        flat[start : start + size] for start, size in zip(offsets, sizes, strict=False)
    )
    ids[:] = np.fromiter(
        itertools.chain.from_iterable(s.token_ids for s in scheduled), np.int64, num_tokens
    )
    starts[0] = 0
    np.cumsum(query_lens, out=starts[1:])
    row_of_token = np.repeat(np.arange(rows), query_lens)
    # num_computed + 0, 1, ... within each request
    positions[:] = num_computed[row_of_token] + np.arange(num_tokens) - starts[row_of_token]
    table = tables.reshape(rows, max_blocks)  # rows padded with the null block
    table[:] = 0
    for row, request in enumerate(scheduled):
        table[row, : len(request.block_ids)] = request.block_ids
    slots[:] = table[row_of_token, positions // block_size] * block_size + positions % block_size
    seq_lens[:] = num_computed + query_lens
    sampled = np.fromiter((s.sample for s in scheduled), bool, rows)
    num_sampled = int(sampled.sum())
    samples[:num_sampled] = starts[1:][sampled] - 1
    on_device = host.to(device, non_blocking=True)
    (ids_t, positions_t, slots_t, starts_t, seq_lens_t, samples_t, tables_t) = (
        on_device[start : start + size] for start, size in zip(offsets, sizes, strict=False)
    )
    metadata = AttentionMetadata(
        slot_mapping=slots_t,
        block_tables=tables_t.view(rows, max_blocks),
        query_start_loc=starts_t,
        seq_lens=seq_lens_t,
        query_lens_cpu=tuple(query_lens.tolist()),
        seq_lens_cpu=tuple(seq_lens.tolist()),
        block_size=block_size,
    )
    return ModelInputs(
        input_ids=ids_t,
        positions=positions_t,
        metadata=metadata,
        sample_indices=samples_t[:num_sampled],
    )
