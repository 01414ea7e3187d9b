"""The online miss-ratio curve: exact LRU stack distances when every hash is tracked, a bounded
sample when not, and the KV cache manager reporting admissions and releases to it."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from blockserve.core.hashing import BlockHash
from blockserve.core.miss_ratio import MissRatioCurve
from blockserve.errors import InvalidConfigError
from tests.core.helpers import admit, make_manager, make_request

B = 4


def h(value: int) -> BlockHash:
    return BlockHash(value.to_bytes(8, "big"))


Trace = list[tuple[list[BlockHash], int]]  # (a request's hashed blocks, its prompt tokens)


def feed(curve: MissRatioCurve, trace: Trace) -> None:
    for hashes, num_tokens in trace:
        curve.record_lookup(hashes, num_tokens)
        curve.record_release(hashes)


def exact_lru_hit_tokens(trace: Trace, capacity: int) -> int:
    """LRU stack distances the slow, obvious way: a list, most recent last. Each request's
    blocks are used at its lookup and again at its release, deepest first."""
    stack: list[BlockHash] = []
    hit_tokens = 0
    for hashes, num_tokens in trace:
        for block_hash in hashes[: (num_tokens - 1) // B]:
            if block_hash in stack and len(stack) - 1 - stack.index(block_hash) < capacity:
                hit_tokens += B
        for _ in ("lookup", "release"):
            for block_hash in reversed(hashes):
                if block_hash in stack:
                    stack.remove(block_hash)
                stack.append(block_hash)
    return hit_tokens


def test_hand_trace_distances() -> None:
    """[1,2] [3] [1,2]: releases use 2 then 1, so at the repeat only 3 was used since 1
    (distance 1: a hit from capacity 2) and 1 and 3 since 2 (distance 2: from capacity 3),
    parent before child. Queries: 9 + 5 + 9 tokens."""
    curve = MissRatioCurve(B, capacities=(1, 2, 3, 8))
    feed(curve, [([h(1), h(2)], 9), ([h(3)], 5), ([h(1), h(2)], 9)])
    assert curve.query_tokens == 23 and curve.num_requests == 3
    assert curve.point_hit_rates() == ((1, 0.0), (2, 4 / 23), (3, 8 / 23), (8, 8 / 23))
    assert [rate for _, rate in curve.curve([2, 3])] == [4 / 23, 8 / 23]


def test_a_request_running_beside_another_hits_its_blocks() -> None:
    """The same prompt admitted twice before either is released (a batch): the first one's
    blocks were stored at its admission, so the second hits both."""
    curve = MissRatioCurve(B, capacities=(2, 8))
    curve.record_lookup([h(1), h(2)], 9)
    curve.record_lookup([h(1), h(2)], 9)
    assert curve.point_hit_rates() == ((2, 8 / 18), (8, 8 / 18))


def test_the_last_token_is_never_counted_a_hit() -> None:
    """An 8-token prompt of 2 full blocks may hit only its first: (8 - 1) // 4 = 1."""
    curve = MissRatioCurve(B, capacities=(10,))
    feed(curve, [([h(1), h(2)], 8), ([h(1), h(2)], 8)])
    assert curve.point_hit_rates() == ((10, 4 / 16),)


trace_strategy = st.lists(
    st.tuples(
        st.lists(st.integers(0, 30).map(h), min_size=0, max_size=6, unique=True),
        st.integers(1, 30),
    ),
    min_size=1,
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(trace=trace_strategy)
def test_unsampled_curve_equals_exact_lru_stack_distances(trace: Trace) -> None:
    """Fewer distinct hashes than max_samples: the estimate is exact at every capacity."""
    capacities = (1, 2, 3, 5, 8, 13, 40)
    curve = MissRatioCurve(B, capacities, max_samples=64)
    feed(curve, trace)
    queries = sum(num_tokens for _, num_tokens in trace)
    assert curve.sampling_rate == 1.0
    for capacity, rate in curve.point_hit_rates():
        assert rate == exact_lru_hit_tokens(trace, capacity) / queries, capacity
        assert curve.hit_rate(capacity) == rate


def test_the_sample_stays_within_its_budget() -> None:
    """10,000 distinct hashes through a 100-sample budget: at most 100 tracked, the rate fell
    to about 100 / 10,000, and every tracked hash is below the threshold."""
    curve = MissRatioCurve(B, max_samples=100)
    feed(curve, [([h(i)], 5) for i in range(10_000)])
    assert curve.num_tracked <= 100
    assert 0.005 < curve.sampling_rate < 0.02


def test_forget_blocks_keeps_the_counted_lookups() -> None:
    """After a cache reset nothing is a hit any more, but the lookups counted stay."""
    curve = MissRatioCurve(B, capacities=(8,))
    feed(curve, [([h(1)], 5), ([h(1)], 5)])
    curve.forget_blocks()
    feed(curve, [([h(1)], 5)])
    assert curve.point_hit_rates() == ((8, 4 / 15),)


def test_a_bad_budget_is_a_config_error() -> None:
    """max_samples must be positive."""
    with pytest.raises(InvalidConfigError, match="max_samples must be positive"):
        MissRatioCurve(B, max_samples=0)


def run(manager_tokens: Sequence[list[int]], curve: MissRatioCurve) -> list[int]:
    manager = make_manager(num_blocks=5)  # 4 usable blocks
    manager.track_miss_ratio(curve)
    hits = []
    for index, token_ids in enumerate(manager_tokens):
        request = make_request(f"r{index}", token_ids)
        num_hits = admit(manager, request)
        assert num_hits is not None
        hits.append(num_hits)
        manager.free(request)
    return hits


def test_the_manager_reports_admissions_and_releases() -> None:
    """A 4-block pool under LRU: the estimate at 4 blocks equals the pool's own hit rate, and
    a bigger cache would have kept the first prompt for its repeat."""
    prompts = [list(range(9)), list(range(9)), list(range(100, 116)), list(range(9))]
    curve = MissRatioCurve(B, capacities=(4, 6))
    hits = run(prompts, curve)
    assert hits == [0, 8, 0, 0]  # the 4-block prompt evicted both of range(9)'s blocks
    assert curve.point_hit_rates() == ((4, 8 / 43), (6, 16 / 43))
