"""Segmented policies: a probation segment evicted before a protected one."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence

from blockserve.core.eviction.base import HitTracking
from blockserve.core.free_queue import KVCacheBlock
from blockserve.core.hashing import BlockHash


class SegmentedLRUPolicy(HitTracking):
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
