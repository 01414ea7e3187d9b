"""What the block pool needs of an eviction policy, and the parts the non-LRU policies share."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Protocol

from blockserve.core.free_queue import FreeBlockQueue, KVCacheBlock
from blockserve.core.hashing import BlockHash


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

    def on_freed(self, blocks: Sequence[KVCacheBlock], priority: int, num_tokens: int) -> None:
        """A request of `priority` and `num_tokens` tokens let go of `blocks`, its block
        table tail-first (the k-th is block len - 1 - k); some may still be held by others."""


class HitTracking:
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

    def on_freed(self, blocks: Sequence[KVCacheBlock], priority: int, num_tokens: int) -> None:
        return None

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
