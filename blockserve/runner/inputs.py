"""A step's flat batch: token ids, positions, slots and block tables, built once per step."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

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
    """Flatten the step into token ids, positions, slots and block tables."""
    scheduled = scheduler_output.scheduled
    query_lens = [len(s.token_ids) for s in scheduled]
    seq_lens = [s.num_computed_tokens + n for s, n in zip(scheduled, query_lens, strict=True)]
    max_blocks = max(len(s.block_ids) for s in scheduled)
    # One tensor for the whole step, rows padded with the null block.
    block_tables = torch.tensor(
        [(*s.block_ids, *(0,) * (max_blocks - len(s.block_ids))) for s in scheduled],
        dtype=torch.int64,
    )
    query_lens_t = torch.tensor(query_lens, dtype=torch.int64)
    row_of_token = torch.repeat_interleave(torch.arange(len(scheduled)), query_lens_t)
    starts = list(itertools.accumulate(query_lens, initial=0))  # each row's first token
    query_start_loc = torch.tensor(starts, dtype=torch.int64)
    num_computed = torch.tensor([s.num_computed_tokens for s in scheduled], dtype=torch.int64)
    # positions: num_computed + 0, 1, ... within each request
    offsets = torch.arange(len(row_of_token)) - query_start_loc[row_of_token]
    positions = num_computed[row_of_token] + offsets
    slot_mapping = (
        block_tables[row_of_token, positions // block_size] * block_size + positions % block_size
    )
    input_ids = torch.tensor([t for s in scheduled for t in s.token_ids], dtype=torch.int64)
    sample_indices = torch.tensor(
        [starts[i + 1] - 1 for i, s in enumerate(scheduled) if s.sample], dtype=torch.int64
    )
    metadata = AttentionMetadata(
        slot_mapping=slot_mapping.to(device),
        block_tables=block_tables.to(device),
        query_start_loc=query_start_loc.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int64, device=device),
        query_lens_cpu=tuple(query_lens),
        seq_lens_cpu=tuple(seq_lens),
        block_size=block_size,
    )
    return ModelInputs(
        input_ids=input_ids.to(device),
        positions=positions.to(device),
        metadata=metadata,
        sample_indices=sample_indices.to(device),
    )
