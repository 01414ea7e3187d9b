"""An online miss-ratio curve: the prefix-cache hit rate an LRU cache of any other size would have
had on the traffic seen so far, from one pass over the block hashes. Owns a sampled LRU stack of
block hashes and a histogram of reuse distances. Must not touch the pool: the KV cache manager
reports admissions and releases to it, and it only reads hashes."""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Iterable, Sequence

from blockserve.core.hashing import BlockHash
from blockserve.errors import InvalidConfigError

_MODULUS = 1 << 24  # a hash is sampled when its 24-bit sample value < threshold
_GOLDEN = 0x9E3779B97F4A7C15
_MASK64 = (1 << 64) - 1
_SHIFT = 64 - 24
_EXACT_DISTANCES = 4096  # distances below this are kept exactly; above, to 1/256 of their size


def sample_value(block_hash: BlockHash) -> int:
    """A hash's 24-bit sample value: Fibonacci hashing (a multiply by 2^64 / golden ratio,
    keep the top bits) of its last 8 bytes, so hashes that are not themselves random (a
    trace's small integer ids) spread evenly too."""
    return ((int.from_bytes(block_hash[-8:], "big") * _GOLDEN) & _MASK64) >> _SHIFT


def _distance_bucket(distance: int) -> int:
    """The histogram key of a (scaled) reuse distance: exact below 4,096, then rounded down to
    its top 8 bits, so the histogram stays small whatever the traffic."""
    if distance < _EXACT_DISTANCES:
        return distance
    shift = distance.bit_length() - 8
    return (distance >> shift) << shift


class _Fenwick:
    """Prefix sums over access times 0..size-1 (1 where a tracked hash was last accessed)."""

    __slots__ = ("_size", "_tree")

    def __init__(self, size: int) -> None:
        self._size = size + 1
        self._tree = [0] * (size + 1)

    def add(self, index: int, delta: int) -> None:
        index += 1
        tree, size = self._tree, self._size
        while index < size:
            tree[index] += delta
            index += index & -index

    def prefix(self, index: int) -> int:
        """Sum over times 0..index-1."""
        total = 0
        tree = self._tree
        while index > 0:
            total += tree[index]
            index -= index & -index
        return total


class _ReuseStack:
    """The last use of each tracked hash, in use order, and how many tracked hashes were used
    since one of them: an LRU stack distance in O(log n). At most `size` hashes: the caller
    drops one (`drop`, or `drop_least_recent`) before going past it."""

    __slots__ = ("_last", "_now", "_size", "_times")

    def __init__(self, size: int) -> None:
        self._size = size
        self._last: OrderedDict[BlockHash, int] = OrderedDict()  # least recently used first
        self._times = _Fenwick(8 * size)
        self._now = 0

    def __len__(self) -> int:
        return len(self._last)

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self._last

    def num_used(self) -> int:
        """How many tracked hashes there are (each has one last use)."""
        return self._times.prefix(self._now)

    def used_since(self, block_hash: BlockHash, num_used: int) -> int | None:
        """Tracked hashes used after `block_hash` last was (`num_used` from `num_used()`);
        None if it is not tracked."""
        last = self._last.get(block_hash)
        return None if last is None else num_used - self._times.prefix(last + 1)

    def use(self, block_hash: BlockHash) -> None:
        last = self._last.pop(block_hash, None)
        if last is not None:
            self._times.add(last, -1)
        if self._now == 8 * self._size:
            self._compact()
        self._times.add(self._now, 1)
        self._last[block_hash] = self._now  # re-inserted: last in use order
        self._now += 1

    def drop(self, block_hash: BlockHash) -> None:
        self._times.add(self._last.pop(block_hash), -1)

    def drop_least_recent(self) -> None:
        _, last = self._last.popitem(last=False)
        self._times.add(last, -1)

    def _compact(self) -> None:
        """Renumber the tracked hashes' last uses 0..n-1, in order, and rebuild the tree."""
        self._times = _Fenwick(8 * self._size)
        for time, block_hash in enumerate(self._last):
            self._last[block_hash] = time
            self._times.add(time, 1)
        self._now = len(self._last)


class MissRatioCurve:
    """SHARDS (Waldspurger, Park, Garthwaite and Ahmad, FAST '15) over block hashes, with a fixed
    sample budget, and reuse distances below the budget counted exactly.

    Model: the pool's LRU order. A request's lookup asks for its hittable blocks (at most
    `(num_tokens - 1) // block_size`), then uses its full blocks (it holds them while it runs,
    and requests beside it can hit them); on release all its hashed blocks are used again,
    deepest first, so its first block ends most recent (as tail-first freeing leaves them). A
    block hits in an LRU cache of C blocks iff fewer than C distinct blocks were used since its
    last use; a parent is always used after its children, so the hits are a prefix, as the
    engine's lookup requires. C counts hashed blocks: the pool also holds each running
    request's partial last block, so read the curve a little below the pool's size.

    Exact window: the `max_samples` most recently used hashes, all of them, give every reuse
    distance below `max_samples` exactly. The hot blocks of real traffic (a system prompt
    every request opens with) live there. Sampled alone, one of them drawn into the sample
    counted 1/R times over at every use: a trace whose every request opened with the same 10
    blocks read 36% where LRU hit 22%, and a real one 100% where LRU hit 4-27%.

    Sample, for the distances beyond the window: a hash is tracked iff its `sample_value`
    falls below a threshold, rate R = threshold / 2^24; a distance among tracked hashes is
    scaled by 1/R and each such lookup counts 1/R. When more than `max_samples` hashes are
    tracked, the one with the largest value is dropped and the threshold lowered to it (so R
    only falls). With fewer distinct blocks than `max_samples` the curve is exact. Memory and
    time per block are O(max_samples) and O(log max_samples), whatever the traffic.
    """

    def __init__(
        self, block_size: int, capacities: Sequence[int] = (), max_samples: int = 4096
    ) -> None:
        if max_samples < 1:
            raise InvalidConfigError(f"max_samples must be positive, got {max_samples}")
        self.block_size = block_size
        self.capacities = tuple(capacities)  # kept current at every lookup: O(1) to read
        self.max_samples = max_samples
        self.reset()

    def reset(self) -> None:
        """Forget all traffic: no lookups counted, back to sampling every hash."""
        self._histogram: dict[int, float] = {}  # distance bucket -> weight of lookups
        self._point_hits = [0.0] * len(self.capacities)
        self.query_tokens = 0
        self.num_requests = 0
        self._threshold = _MODULUS
        self.forget_blocks()

    def forget_blocks(self) -> None:
        """Every cache size was emptied (a prefix-cache reset): no block has a last use any
        more; the lookups counted so far stay."""
        self._recent = _ReuseStack(self.max_samples)  # every hash, the most recent only
        self._sampled = _ReuseStack(self.max_samples)  # hashes below the threshold
        self._largest: list[tuple[int, BlockHash]] = []  # (-sample value, hash): max first

    @property
    def sampling_rate(self) -> float:
        return self._threshold / _MODULUS

    @property
    def num_tracked(self) -> int:
        """Hashes in the sample (the exact window holds as many again, at most)."""
        return len(self._sampled)

    def record_lookup(self, block_hashes: Sequence[BlockHash], num_tokens: int) -> None:
        """A request is admitted: histogram the reuse distance of each hittable block
        (never-used blocks are misses at every size), then use all of `block_hashes`, which
        it stores or holds from now on, so that requests running beside it hit them."""
        self.num_requests += 1
        self.query_tokens += num_tokens
        num_hittable = (num_tokens - 1) // self.block_size
        window = self.max_samples
        weight = 1.0 / self.sampling_rate
        recent_used = self._recent.num_used()  # the same for every block: none is used here
        sampled_used = self._sampled.num_used()
        for block_hash in block_hashes[:num_hittable]:
            distance = self._recent.used_since(block_hash, recent_used)
            if distance is not None:
                self._count_hit(distance, 1.0)
                continue
            since = self._sampled.used_since(block_hash, sampled_used)
            if since is not None:  # out of the window: at least `window` away, sampling aside
                self._count_hit(max(int(since * weight), window), weight)
        self.record_release(block_hashes)

    def record_release(self, block_hashes: Sequence[BlockHash]) -> None:
        """A request lets go of its hashed blocks (token order): use them, deepest first."""
        recent = self._recent
        for block_hash in reversed(block_hashes):
            if block_hash not in recent and len(recent) == self.max_samples:
                recent.drop_least_recent()
            recent.use(block_hash)
            # sample_value, inlined: this loop runs for every block of every request.
            value = ((int.from_bytes(block_hash[-8:], "big") * _GOLDEN) & _MASK64) >> _SHIFT
            if value < self._threshold:
                self._sample(block_hash, value)

    def hit_rate(self, capacity_blocks: int) -> float:
        """Estimated token hit rate of an LRU cache of `capacity_blocks` blocks."""
        if not self.query_tokens:
            return 0.0
        hit_blocks = sum(w for distance, w in self._histogram.items() if distance < capacity_blocks)
        return min(hit_blocks * self.block_size / self.query_tokens, 1.0)

    def curve(self, capacities: Iterable[int]) -> list[tuple[int, float]]:
        """(capacity in blocks, estimated hit rate) for each capacity; O(histogram) each."""
        return [(capacity, self.hit_rate(capacity)) for capacity in capacities]

    def point_hit_rates(self) -> tuple[tuple[int, float], ...]:
        """(capacity, estimated hit rate) at the `capacities` given at construction, exact
        (not bucketed) and cheap enough to read after every step."""
        tokens = self.query_tokens
        return tuple(
            (capacity, min(hits * self.block_size / tokens, 1.0) if tokens else 0.0)
            for capacity, hits in zip(self.capacities, self._point_hits, strict=True)
        )

    def _count_hit(self, distance: int, weight: float) -> None:
        key = _distance_bucket(distance)
        self._histogram[key] = self._histogram.get(key, 0.0) + weight
        for index, capacity in enumerate(self.capacities):
            if distance < capacity:
                self._point_hits[index] += weight

    def _sample(self, block_hash: BlockHash, value: int) -> None:
        if block_hash not in self._sampled:
            heapq.heappush(self._largest, (-value, block_hash))
        self._sampled.use(block_hash)
        if len(self._sampled) > self.max_samples:
            self._lower_threshold()

    def _lower_threshold(self) -> None:
        """Sample only below the largest tracked value from now on, and drop every tracked hash
        at or above it (several hashes can share a value)."""
        self._threshold = -self._largest[0][0]
        while self._largest and -self._largest[0][0] >= self._threshold:
            _, block_hash = heapq.heappop(self._largest)
            self._sampled.drop(block_hash)
