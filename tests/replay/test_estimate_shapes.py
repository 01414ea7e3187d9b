"""The online miss-ratio curve against replayed LRU on traces of four shapes, with a sample
budget small enough (1,024 hashes) that every trace is sampled: within 2 points everywhere.
The skewed shape is the one that read 100% before the exact window (every request opens with
the same blocks, which the sample weighed 1/R times over)."""

from __future__ import annotations

import random

import pytest

from blockserve.replay.simulate import estimate_lru, replay_policy
from blockserve.replay.trace import block_layouts
from tests.replay.trace_shapes import BLOCK, SHAPES

CAPACITIES = (128, 512, 2048, 8192)


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_the_estimate_is_within_two_points_of_replayed_lru(shape: str, seed: int) -> None:
    """At 128 to 8,192 blocks, below and far above the 1,024-hash window."""
    trace = SHAPES[shape](random.Random(seed))
    layouts = block_layouts(trace, BLOCK)
    assert len({h for layout in layouts for h in layout.block_hashes}) > 1024  # sampled
    estimates = estimate_lru(trace, layouts, CAPACITIES, BLOCK, max_samples=1024)
    for estimate in estimates:
        replayed, _ = replay_policy(trace, layouts, estimate.capacity_blocks, "lru", BLOCK)
        estimated = estimate.hit_tokens / estimate.query_tokens
        actual = replayed.hit_tokens / replayed.query_tokens
        assert abs(estimated - actual) <= 0.02, (estimate.capacity_blocks, estimated, actual)
