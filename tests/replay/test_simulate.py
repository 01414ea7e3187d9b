"""Trace replay through the real pool, beside the infinite-cache and Belady bounds."""

from __future__ import annotations

from collections import OrderedDict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from blockserve.replay.simulate import (
    estimate_lru,
    replay_belady,
    replay_infinite,
    replay_policy,
)
from blockserve.replay.trace import TraceRequest, block_layouts, load_trace
from tests.replay.test_trace import SAMPLE_TRACE

B = 4  # tokens per trace block in these tiny worlds


def request(ids: list[int], output_length: int = 0) -> TraceRequest:
    """A prompt of len(ids) full blocks plus one partial token (so every full block can hit)."""
    return TraceRequest(0.0, len(ids) * B + 1, output_length, (*ids, 10_000 + ids[0]))


HAND_TRACE = [request([1, 2]), request([1, 2]), request([3, 4]), request([5, 6]), request([1, 2])]


@pytest.mark.parametrize(
    ("policy", "hit_blocks"),
    [("lru", 2), ("lfu", 3), ("slru", 3), ("ghost", 3), ("belady", 4), ("infinite", 4)],
)
def test_hand_trace_hit_counts(policy: str, hit_blocks: int) -> None:
    """Capacity 4 blocks: [1,2] [1,2] [3,4] [5,6] [1,2] (worked out in the docstring below).

    lru: the repeat hits both blocks, then [3,4] and [5,6] push out 2 and 1 → 2 hits.
    lfu, slru, ghost: block 1 (hit once) outlives the one-off blocks; 2 was reused by [3,4]
    → 3 hits. belady (4 hashes): evicts the never-reused 4 and 3, keeps 1, 2 → 4 hits.
    """
    layouts = block_layouts(HAND_TRACE, B)
    if policy == "belady":
        result = replay_belady(HAND_TRACE, layouts, 4, B)
    elif policy == "infinite":
        result = replay_infinite(HAND_TRACE, layouts, B)
    else:
        result, manager = replay_policy(HAND_TRACE, layouts, 4, policy, B)
        assert manager.integrity_errors() == []
    assert (result.hit_blocks, result.query_blocks) == (hit_blocks, 10)
    assert (result.hit_tokens, result.query_tokens) == (hit_blocks * B, 45)


def test_last_prompt_token_is_never_a_hit() -> None:
    """An 8-token prompt repeated hits 1 block of 4, not 2: the last token is recomputed."""
    trace = [TraceRequest(0, 8, 0, (1, 2)), TraceRequest(0, 8, 0, (1, 2))]
    result, _ = replay_policy(trace, block_layouts(trace, B), 10, "lru", B)
    assert (result.hit_tokens, result.query_tokens) == (4, 16)


def test_requests_larger_than_the_cache_are_skipped() -> None:
    """A request needing more blocks than the capacity is skipped by policies and bounds."""
    trace = [request([1, 2, 3]), request([1, 2])]
    layouts = block_layouts(trace, B)
    result, _ = replay_policy(trace, layouts, 3, "lru", B)
    assert (result.num_skipped, result.query_blocks) == (1, 2)
    assert replay_belady(trace, layouts, 3, B).num_skipped == 1


def plain_lru_hits(trace: list[TraceRequest], capacity: int, block_size: int) -> int:
    """An independent LRU simulation with the engine's rules (physical slots, duplicates)."""
    free: OrderedDict[int, bytes | None] = OrderedDict((slot, None) for slot in range(capacity))
    where: dict[bytes, set[int]] = {}
    total_hits = 0
    for index, req in enumerate(trace):
        full = req.input_length // block_size
        keys = [b"p%d" % h for h in req.hash_ids[:full]]
        total = req.input_length + req.output_length
        keys += [b"o%d.%d" % (index, i) for i in range(full, total // block_size)]
        hits = []
        for key in keys[: (req.input_length - 1) // block_size]:
            slot = next(iter(where.get(key, ())), None)
            if slot is None:
                break
            hits.append(slot)
        for slot in hits:
            free.pop(slot, None)
        owned = list(hits)
        for _ in range(-(-total // block_size) - len(hits)):
            slot, old = free.popitem(last=False)
            if old is not None:
                where[old].discard(slot)
                if not where[old]:
                    del where[old]
            owned.append(slot)
        for position, slot in enumerate(owned[: len(keys)]):
            if position >= len(hits):
                where.setdefault(keys[position], set()).add(slot)
        total_hits += len(hits)
        for slot in owned[len(keys) :]:  # unhashed tail blocks go to the head, deepest first
            free[slot] = None
            free.move_to_end(slot, last=False)
        for position in reversed(range(min(len(owned), len(keys)))):
            free[owned[position]] = keys[position]
    return total_hits


trace_strategy = st.lists(
    st.builds(
        lambda chain, depth, extra, out: TraceRequest(
            0.0, depth * B + extra, out, tuple(chain * 100 + i for i in range(depth + 1))
        ),
        chain=st.integers(0, 5),
        depth=st.integers(1, 5),
        extra=st.integers(1, B - 1),
        out=st.integers(0, 9),
    ),
    min_size=1,
    max_size=40,
)


@settings(max_examples=100, deadline=None)
@given(trace=trace_strategy, capacity=st.integers(9, 24))
def test_lru_replay_equals_a_plain_lru_simulation(trace: list[TraceRequest], capacity: int) -> None:
    """The replayer's LRU hits equal an independently written LRU simulation's."""
    result, manager = replay_policy(trace, block_layouts(trace, B), capacity, "lru", B)
    assert result.hit_blocks == plain_lru_hits(trace, capacity, B)
    assert manager.integrity_errors() == []


@settings(max_examples=100, deadline=None)
@given(trace=trace_strategy, capacity=st.integers(9, 24))
def test_belady_bounds_every_policy_and_infinite_bounds_belady(
    trace: list[TraceRequest], capacity: int
) -> None:
    """On hit blocks: every policy ≤ Belady ≤ infinite, and the pool stays sound."""
    layouts = block_layouts(trace, B)
    belady = replay_belady(trace, layouts, capacity, B)
    infinite = replay_infinite(trace, layouts, B, capacity)
    assert belady.hit_blocks <= infinite.hit_blocks
    for policy in ("lru", "lfu", "slru", "ghost"):
        result, manager = replay_policy(trace, layouts, capacity, policy, B)
        assert result.hit_blocks <= belady.hit_blocks, policy
        assert manager.integrity_errors() == []


@pytest.mark.slow
def test_the_online_curve_tracks_lru_replay_on_the_sample_trace() -> None:
    """The synthetic Mooncake trace (512-token blocks): the miss-ratio curve's one-pass estimate
    (4,096 sampled hashes of 43,924) is within 2 points of replaying LRU at each capacity."""
    trace = load_trace(SAMPLE_TRACE)
    layouts = block_layouts(trace, 512)
    capacities = (512, 2048, 8192, 32768)
    estimates = estimate_lru(trace, layouts, capacities, 512)
    assert [e.capacity_blocks for e in estimates] == list(capacities)
    for estimate in estimates:
        assert estimate.capacity_blocks is not None
        replayed, _ = replay_policy(trace, layouts, estimate.capacity_blocks, "lru", 512)
        assert abs(estimate.token_hit_rate - replayed.token_hit_rate) < 0.02, estimate
