"""A step's flat batch: exact token ids, positions, slots, tables and sampled rows."""

from __future__ import annotations

import torch

from blockserve.runner.inputs import prepare_inputs
from blockserve.sched.output import ScheduledRequest, SchedulerOutput


def test_a_mixed_step_flattens_to_exact_positions_and_slots() -> None:
    """A chunk of 3 tokens after 16 cached ones (second block 4), then a fresh 2-token prefill
    that does not sample yet; block size 16."""
    step = SchedulerOutput(
        (
            ScheduledRequest("a", (5, 6, 7), 16, (3, 4), sample=True),
            ScheduledRequest("b", (8, 9), 0, (7,), sample=False),
        )
    )
    inputs = prepare_inputs(step, block_size=16, device=torch.device("cpu"))
    assert inputs.input_ids.tolist() == [5, 6, 7, 8, 9]
    assert inputs.positions.tolist() == [16, 17, 18, 0, 1]
    assert inputs.metadata.slot_mapping.tolist() == [64, 65, 66, 112, 113]
    assert inputs.metadata.block_tables.tolist() == [[3, 4], [7, 0]]
    assert inputs.metadata.query_start_loc.tolist() == [0, 3, 5]
    assert inputs.metadata.seq_lens.tolist() == [19, 2]
    assert (inputs.metadata.query_lens_cpu, inputs.metadata.seq_lens_cpu) == ((3, 2), (19, 2))
    assert inputs.sample_indices.tolist() == [2]


def test_the_step_is_one_buffer_of_aligned_arrays() -> None:
    """One transfer carries the whole step: every array is a view of one buffer, each
    starting 16-byte aligned whatever the counts (here 3 tokens, 3 rows)."""
    step = SchedulerOutput(
        (
            ScheduledRequest("a", (5,), 20, (3, 4), sample=True),
            ScheduledRequest("b", (6,), 4, (2,), sample=True),
            ScheduledRequest("c", (7,), 40, (5, 6, 8), sample=False),
        )
    )
    inputs = prepare_inputs(step, block_size=16, device=torch.device("cpu"))
    metadata = inputs.metadata
    arrays = [
        inputs.input_ids, inputs.positions, metadata.slot_mapping, metadata.query_start_loc,
        metadata.seq_lens, inputs.sample_indices, metadata.block_tables,
    ]  # fmt: skip
    storage = inputs.input_ids.untyped_storage().data_ptr()
    assert {array.untyped_storage().data_ptr() for array in arrays} == {storage}
    assert [array.data_ptr() % 16 for array in arrays] == [0] * 7
    assert inputs.positions.tolist() == [20, 4, 40]
    assert metadata.slot_mapping.tolist() == [4 * 16 + 4, 2 * 16 + 4, 8 * 16 + 8]
    assert metadata.block_tables.tolist() == [[3, 4, 0], [2, 0, 0], [5, 6, 8]]
    assert inputs.sample_indices.tolist() == [0, 1]
