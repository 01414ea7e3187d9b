"""Eviction policies: which free cached block the pool hands out (and so evicts) next.

A policy owns the free blocks' order. Every policy keeps the pool's invariants: only free
blocks (ref_cnt 0) are ever handed out, unhashed free blocks go before any cached one, and
among blocks freed together (a request's, tail-first) the deeper block goes first on ties.

- `lru` — `FreeBlockQueue` itself: least recently freed first. The default, and no slower.
- `lfu` — fewest hits first; ties by least recently freed.
- `slru` — segmented LRU: blocks never hit since cached sit in a probationary segment and go
  first; blocks hit at least once sit in a protected segment (at most 80% of the pool).
- `ghost` — blockserve's admission-aware policy for traces where most blocks are used once:
  like slru, a new block waits in probation and is evicted before any block that was hit; the
  hashes of recently evicted blocks are remembered (a ghost list as long as the pool), and a
  block cached again under a remembered hash — it came back — enters protected directly.
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from typing import Protocol

from blockserve.core.free_queue import FreeBlockQueue, KVCacheBlock
from blockserve.core.hashing import BlockHash
from blockserve.errors import InvalidConfigError

EVICTION_POLICIES = ("lru", "lfu", "slru", "ghost")


class FreeBlockPolicy(Protocol):
    """What the block pool needs of its free-block order."""

    @property
    def num_free_blocks(self) -> int: ...

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        """The next `n` blocks to hand out, removed from the free set."""

    def remove(self, block: KVCacheBlock) -> None:
        """A free block was hit and leaves the free set."""

    def append_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Cached blocks become free; earlier ones are evicted first on ties."""

    def prepend_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Unhashed blocks become free; they are reused before any cached block."""

    def __iter__(self) -> Iterator[KVCacheBlock]:
        """The free blocks, in the order they would be handed out."""

    def block_ids(self) -> list[int]: ...


class HitAwarePolicy(FreeBlockPolicy, Protocol):
    """A policy that also hears of hits, new cache entries and evictions."""

    def record_hit(self, block: KVCacheBlock) -> None: ...

    def on_cached(self, block: KVCacheBlock) -> None: ...

    def on_evicted(self, block_hash: BlockHash) -> None: ...

    def on_reset(self) -> None: ...


class _HitTracking:
    """Shared parts of the non-LRU policies: an unhashed queue reused first, hit counts."""

    def __init__(self, blocks: Sequence[KVCacheBlock], num_blocks: int) -> None:
        self.unhashed = FreeBlockQueue(blocks)
        self.hits = [0] * num_blocks
        self._num_cached_free = 0

    @property
    def num_free_blocks(self) -> int:
        return self.unhashed.num_free_blocks + self._num_cached_free

    def block_ids(self) -> list[int]:
        return [block.block_id for block in self]

    def prepend_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        self.unhashed.prepend_n(blocks)

    def record_hit(self, block: KVCacheBlock) -> None:
        self.hits[block.block_id] += 1

    def on_cached(self, block: KVCacheBlock) -> None:
        self.hits[block.block_id] = 0

    def on_evicted(self, block_hash: BlockHash) -> None:
        return None

    def on_reset(self) -> None:
        self.hits = [0] * len(self.hits)

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        if n > self.num_free_blocks:
            raise IndexError(f"cannot pop {n} blocks from {self.num_free_blocks} free")
        from_unhashed = min(n, self.unhashed.num_free_blocks)
        blocks = self.unhashed.popleft_n(from_unhashed)
        blocks.extend(self._pop_cached() for _ in range(n - from_unhashed))
        return blocks

    def remove(self, block: KVCacheBlock) -> None:
        if block.prev_free_block is not None:  # linked: it is in the unhashed queue
            self.unhashed.remove(block)
        else:
            self._remove_cached(block)

    def __iter__(self) -> Iterator[KVCacheBlock]:
        raise NotImplementedError

    def _pop_cached(self) -> KVCacheBlock:
        raise NotImplementedError

    def _remove_cached(self, block: KVCacheBlock) -> None:
        raise NotImplementedError


class LFUPolicy(_HitTracking):
    """Fewest hits first; ties by least recently freed (so a request's deeper block first)."""

    def __init__(self, blocks: Sequence[KVCacheBlock], num_blocks: int) -> None:
        super().__init__(blocks, num_blocks)
        self._heap: list[tuple[int, int, int]] = []  # (hits, free order, block id)
        self._entry: dict[int, tuple[int, int, int]] = {}  # live entry per free cached block
        self._blocks: dict[int, KVCacheBlock] = {}
        self._order = itertools.count()

    def append_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        for block in blocks:
            entry = (self.hits[block.block_id], next(self._order), block.block_id)
            heapq.heappush(self._heap, entry)
            self._entry[block.block_id] = entry
            self._blocks[block.block_id] = block
            self._num_cached_free += 1

    def _pop_cached(self) -> KVCacheBlock:
        while True:
            entry = heapq.heappop(self._heap)
            if self._entry.get(entry[2]) is entry:  # skip entries of blocks hit since
                del self._entry[entry[2]]
                self._num_cached_free -= 1
                return self._blocks.pop(entry[2])

    def _remove_cached(self, block: KVCacheBlock) -> None:
        del self._entry[block.block_id]
        del self._blocks[block.block_id]
        self._num_cached_free -= 1

    def __iter__(self) -> Iterator[KVCacheBlock]:
        yield from self.unhashed
        for entry in sorted(self._entry.values()):
            yield self._blocks[entry[2]]


class SegmentedLRUPolicy(_HitTracking):
    """Probation (never hit) is evicted before protected (hit); each segment in LRU order."""

    PROTECTED_FRACTION = 0.8

    def __init__(self, blocks: Sequence[KVCacheBlock], num_blocks: int) -> None:
        super().__init__(blocks, num_blocks)
        self.probation: OrderedDict[int, KVCacheBlock] = OrderedDict()
        self.protected: OrderedDict[int, KVCacheBlock] = OrderedDict()
        self.protected_capacity = max(1, int(self.PROTECTED_FRACTION * num_blocks))

    def _deserves_protection(self, block: KVCacheBlock) -> bool:
        return self.hits[block.block_id] > 0

    def append_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        for block in blocks:
            segment = self.protected if self._deserves_protection(block) else self.probation
            segment[block.block_id] = block
            self._num_cached_free += 1
        # An over-full protected segment demotes its least recently freed blocks.
        while len(self.protected) > self.protected_capacity:
            block_id, block = self.protected.popitem(last=False)
            self.probation[block_id] = block

    def _pop_cached(self) -> KVCacheBlock:
        segment = self.probation if self.probation else self.protected
        self._num_cached_free -= 1
        return segment.popitem(last=False)[1]

    def _remove_cached(self, block: KVCacheBlock) -> None:
        if self.probation.pop(block.block_id, None) is None:
            del self.protected[block.block_id]
        self._num_cached_free -= 1

    def __iter__(self) -> Iterator[KVCacheBlock]:
        yield from self.unhashed
        yield from self.probation.values()
        yield from self.protected.values()


class GhostPolicy(SegmentedLRUPolicy):
    """Segmented LRU whose probation is skipped by blocks that come back after eviction."""

    def __init__(self, blocks: Sequence[KVCacheBlock], num_blocks: int) -> None:
        super().__init__(blocks, num_blocks)
        self.ghosts: OrderedDict[BlockHash, None] = OrderedDict()
        self.ghost_capacity = num_blocks
        self.returning = [False] * num_blocks

    def _deserves_protection(self, block: KVCacheBlock) -> bool:
        return self.hits[block.block_id] > 0 or self.returning[block.block_id]

    def on_cached(self, block: KVCacheBlock) -> None:
        super().on_cached(block)
        assert block.block_hash is not None
        # A hash evicted recently and needed again: its block gets a second chance.
        returning = block.block_hash in self.ghosts
        if returning:
            del self.ghosts[block.block_hash]
        self.returning[block.block_id] = returning

    def on_evicted(self, block_hash: BlockHash) -> None:
        self.ghosts[block_hash] = None
        self.ghosts.move_to_end(block_hash)
        if len(self.ghosts) > self.ghost_capacity:
            self.ghosts.popitem(last=False)

    def on_reset(self) -> None:
        super().on_reset()
        self.ghosts.clear()
        self.returning = [False] * len(self.returning)


def create_free_block_policy(
    name: str, blocks: Sequence[KVCacheBlock], num_blocks: int
) -> FreeBlockQueue | HitAwarePolicy:
    """The policy `name` over the initially free `blocks` (ids < num_blocks)."""
    if name == "lru":
        return FreeBlockQueue(blocks)
    if name == "lfu":
        return LFUPolicy(blocks, num_blocks)
    if name == "slru":
        return SegmentedLRUPolicy(blocks, num_blocks)
    if name == "ghost":
        return GhostPolicy(blocks, num_blocks)
    raise InvalidConfigError(
        f"unknown eviction policy {name!r}; choose one of {', '.join(EVICTION_POLICIES)}"
    )
