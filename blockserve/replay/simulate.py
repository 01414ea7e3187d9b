"""Replaying a trace through the real `KVCacheManager`, and the two bounds beside it."""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from blockserve.core.eviction import EvictionConfig
from blockserve.core.free_queue import KVCacheBlock
from blockserve.core.hashing import BlockHash, BlockKeyInputs
from blockserve.core.kv_cache_manager import KVCacheManager
from blockserve.core.miss_ratio import MissRatioCurve
from blockserve.errors import InvalidConfigError
from blockserve.replay.trace import BlockLayout, TraceRequest

# Requests run one at a time in trace order: look up, allocate the prompt (hits included), grow by
# the output, free. Between requests every block is free, so what a policy keeps cached is all
# that differs between policies. A request needing more blocks than the capacity is skipped (and
# skipped by the bounds too).
#
# The bounds work on sets of block hashes, with the same hit rule (leading cached blocks, at most
# `(input_length - 1) // B`):
# - infinite: every block ever stored stays;
# - Belady: at most `capacity` hashes; on overflow evict the one whose next use (as a prompt
#   block of a later request) is farthest, deeper blocks first on ties, never the current
#   request's own. Parents are then never evicted before their children, so the cache stays
#   prefix-closed and its leading hits are exactly its hits: no policy can beat it on hit blocks.

NEVER = 1 << 62  # "next use" of a block never used again


@dataclass(frozen=True, slots=True)
class ReplayResult:
    policy: str  # an eviction policy, or "infinite" / "belady"
    capacity_blocks: int | None  # None: unbounded
    num_requests: int
    num_skipped: int
    hit_tokens: int
    query_tokens: int
    hit_blocks: int
    query_blocks: int
    evictions: int
    seconds: float

    @property
    def token_hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0

    @property
    def block_hit_rate(self) -> float:
        return self.hit_blocks / self.query_blocks if self.query_blocks else 0.0


@dataclass(slots=True)
class ReplayRequest:
    """The `KVCacheRequest` face of one trace request (its hashes are given, not computed)."""

    request_id: str
    block_hashes: Sequence[BlockHash]
    num_tokens: int
    num_computed_tokens: int = 0
    all_token_ids: Sequence[int] = ()
    lora_name: str | None = None
    cache_salt: str | None = None
    skip_reading_prefix_cache: bool = False
    num_preemptions: int = 0
    priority: int = 0

    @property
    def hash_keys(self) -> BlockKeyInputs:
        """Its keys as its events would carry them (its hashes are the trace's, not these)."""
        return BlockKeyInputs(lora_name=self.lora_name, cache_salt=self.cache_salt)


@dataclass(slots=True)
class _Tally:
    num_skipped: int = 0
    hit_tokens: int = 0
    query_tokens: int = 0
    hit_blocks: int = 0
    query_blocks: int = 0
    started: float = field(default_factory=time.perf_counter)

    def count(
        self, request: TraceRequest, layout: BlockLayout, hit_blocks: int, block_size: int
    ) -> None:
        self.hit_blocks += hit_blocks
        self.query_blocks += layout.num_prompt_blocks
        self.hit_tokens += hit_blocks * block_size
        self.query_tokens += request.input_length

    def result(
        self, policy: str, capacity: int | None, num_requests: int, evictions: int
    ) -> ReplayResult:
        return ReplayResult(
            policy=policy,
            capacity_blocks=capacity,
            num_requests=num_requests,
            num_skipped=self.num_skipped,
            hit_tokens=self.hit_tokens,
            query_tokens=self.query_tokens,
            hit_blocks=self.hit_blocks,
            query_blocks=self.query_blocks,
            evictions=evictions,
            seconds=time.perf_counter() - self.started,
        )


def run_request(
    manager: KVCacheManager,
    replayed: ReplayRequest,
    request: TraceRequest,
    hit_blocks: Sequence[KVCacheBlock],
    num_hits: int,
) -> None:
    """One request after its lookup: allocate the prompt past its `num_hits` cached tokens
    (its full blocks become cached), grow by the output, free."""
    allocated = manager.allocate_slots(
        replayed, request.input_length - num_hits, num_hits, hit_blocks
    )
    assert allocated is not None, "an idle pool of enough blocks must fit one request"
    replayed.num_computed_tokens = request.input_length
    replayed.num_tokens = request.input_length + request.output_length
    if request.output_length:
        assert manager.allocate_slots(replayed, request.output_length) is not None
    manager.free(replayed)


def replay_policy(
    trace: Sequence[TraceRequest],
    layouts: Sequence[BlockLayout],
    capacity: int,
    policy: str,
    block_size: int,
    curve: MissRatioCurve | None = None,
) -> tuple[ReplayResult, KVCacheManager]:
    """Run the trace through a real pool of `capacity` blocks (plus the null block), reporting
    to `curve` (the online miss-ratio curve) when one is given."""
    if capacity < 1:
        raise InvalidConfigError(f"capacity must be at least 1 block, got {capacity}")
    manager = KVCacheManager(
        num_blocks=capacity + 1,
        block_size=block_size,
        enable_caching=True,
        events=None,
        eviction=EvictionConfig(policy),
    )
    if curve is not None:
        manager.track_miss_ratio(curve)
    tally = _Tally()
    for index, (request, layout) in enumerate(zip(trace, layouts, strict=True)):
        if layout.num_blocks > capacity:
            tally.num_skipped += 1
            continue
        replayed = ReplayRequest(
            str(index), layout.block_hashes, request.input_length, lora_name=request.lora_name
        )
        hit_blocks, num_hits = manager.get_computed_blocks(replayed)
        run_request(manager, replayed, request, hit_blocks, num_hits)
        tally.count(request, layout, num_hits // block_size, block_size)
    return tally.result(policy, capacity, len(trace), manager.block_pool.num_evictions), manager


def estimate_lru(
    trace: Sequence[TraceRequest],
    layouts: Sequence[BlockLayout],
    capacities: Sequence[int],
    block_size: int,
    max_samples: int = 4096,
) -> list[ReplayResult]:
    """LRU's hit rate at every capacity from ONE replay, as the engine's online miss-ratio curve
    estimates it (sampled reuse distances; policy name "lru-estimate"). Block counts are the
    token estimate in whole blocks; nothing is evicted by an estimate."""
    curve = MissRatioCurve(block_size, capacities, max_samples)
    result, _ = replay_policy(trace, layouts, max(capacities), "lru", block_size, curve)
    estimates = []
    for capacity, hit_rate in curve.point_hit_rates():
        hit_tokens = round(hit_rate * result.query_tokens)
        estimates.append(
            dataclasses.replace(
                result,
                policy="lru-estimate",
                capacity_blocks=capacity,
                hit_tokens=hit_tokens,
                hit_blocks=hit_tokens // block_size,
                evictions=0,
            )
        )
    return estimates


def _leading_hits(layout: BlockLayout, cached: set[BlockHash] | dict[BlockHash, int]) -> int:
    hits = 0
    for block_hash in layout.block_hashes[: layout.num_hittable_blocks]:
        if block_hash not in cached:
            break
        hits += 1
    return hits


def replay_infinite(
    trace: Sequence[TraceRequest],
    layouts: Sequence[BlockLayout],
    block_size: int,
    capacity: int | None = None,
) -> ReplayResult:
    """Upper bound: nothing is ever evicted. `capacity` only decides which requests are skipped."""
    cached: set[BlockHash] = set()
    tally = _Tally()
    for request, layout in zip(trace, layouts, strict=True):
        if capacity is not None and layout.num_blocks > capacity:
            tally.num_skipped += 1
            continue
        tally.count(request, layout, _leading_hits(layout, cached), block_size)
        cached.update(layout.block_hashes)
    return tally.result("infinite", capacity, len(trace), 0)


def next_uses(layouts: Sequence[BlockLayout]) -> list[list[int]]:
    """For each request and each of its blocks: the index of the next request that has that
    block among its prompt blocks (NEVER if none)."""
    last_seen: dict[BlockHash, int] = {}
    result: list[list[int]] = [[] for _ in layouts]
    for index in range(len(layouts) - 1, -1, -1):
        layout = layouts[index]
        result[index] = [last_seen.get(h, NEVER) for h in layout.block_hashes]
        for block_hash in layout.block_hashes[: layout.num_prompt_blocks]:
            last_seen[block_hash] = index
    return result


def replay_belady(
    trace: Sequence[TraceRequest],
    layouts: Sequence[BlockLayout],
    capacity: int,
    block_size: int,
    uses: list[list[int]] | None = None,
) -> ReplayResult:
    """Belady's offline optimum over block hashes (see the module docstring)."""
    uses = next_uses(layouts) if uses is None else uses
    cached: dict[BlockHash, int] = {}  # hash → its next use
    heap: list[tuple[int, int, int, BlockHash]] = []  # (-next use, -depth, order, hash)
    order = itertools.count()
    evictions = 0
    tally = _Tally()
    for index, (request, layout) in enumerate(zip(trace, layouts, strict=True)):
        if layout.num_blocks > capacity:
            tally.num_skipped += 1
            continue
        tally.count(request, layout, _leading_hits(layout, cached), block_size)
        pinned = set(layout.block_hashes)
        for depth, (block_hash, next_use) in enumerate(
            zip(layout.block_hashes, uses[index], strict=True)
        ):
            if block_hash not in cached and len(cached) >= capacity:
                evictions += 1
                _evict_farthest(cached, heap, pinned)
            cached[block_hash] = next_use
            heapq.heappush(heap, (-next_use, -depth, next(order), block_hash))
    return tally.result("belady", capacity, len(trace), evictions)


def _evict_farthest(
    cached: dict[BlockHash, int],
    heap: list[tuple[int, int, int, BlockHash]],
    pinned: set[BlockHash],
) -> None:
    kept: list[tuple[int, int, int, BlockHash]] = []
    while True:
        entry = heapq.heappop(heap)
        block_hash = entry[3]
        if cached.get(block_hash) != -entry[0]:
            continue  # stale: evicted already, or its next use moved since
        if block_hash in pinned:
            kept.append(entry)
            continue
        del cached[block_hash]
        break
    for entry in kept:
        heapq.heappush(heap, entry)
