"""KV cache blocks and the free queue that orders them for reuse. Owns `KVCacheBlock` (one physical
block's bookkeeping) and `FreeBlockQueue`, an intrusive doubly-linked list threaded through the
blocks themselves, so that taking a cached block out of the middle of the queue on a prefix hit
is O(1). Knows nothing of hashing policy or requests."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

from blockserve.core.hashing import BlockHash


@dataclass(slots=True, eq=False)
class KVCacheBlock:
    """Bookkeeping for one physical KV block.

    Invariants: `ref_cnt` counts the requests holding the block; a block is in the free queue
    exactly when `ref_cnt == 0` (and it is not the null block). `block_hash` is set while the
    block is registered in the prefix cache; a free block may keep its hash (it is then a cache
    entry waiting to be hit or evicted).
    """

    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None
    is_null: bool = False
    # Free-list links, owned by FreeBlockQueue.
    prev_free_block: KVCacheBlock | None = field(default=None, repr=False)
    next_free_block: KVCacheBlock | None = field(default=None, repr=False)


class FreeBlockQueue:
    """The free blocks, in the order they will be handed out (head first).

    Free queue order: least recently freed at the head, so eviction is LRU; a request's blocks
    are freed tail-first, so the deepest block of a chain is evicted first, and unhashed blocks
    (which cache nothing) are put at the head to be reused before any cached block. Every
    operation is O(1) per block: the links live in the blocks and two sentinels bound the list.
    """

    __slots__ = ("_head", "_tail", "num_free_blocks")

    def __init__(self, blocks: Sequence[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(block_id=-1)  # sentinel before the first free block
        self._tail = KVCacheBlock(block_id=-1)  # sentinel after the last free block
        self._head.next_free_block = self._tail
        self._tail.prev_free_block = self._head
        self.num_free_blocks = 0
        self.append_n(blocks)

    def __len__(self) -> int:
        return self.num_free_blocks

    def popleft(self) -> KVCacheBlock:
        """Remove and return the head block (the next to be reused)."""
        block = self._head.next_free_block
        if block is None or block is self._tail:
            raise IndexError("popleft from an empty free queue")
        self.remove(block)
        return block

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        """Remove and return the first `n` blocks, head first."""
        if n > self.num_free_blocks:
            raise IndexError(f"cannot pop {n} blocks from a free queue of {self.num_free_blocks}")
        if n <= 0:
            return []
        blocks: list[KVCacheBlock] = []
        block = self._head.next_free_block
        for _ in range(n):
            assert block is not None
            blocks.append(block)
            next_block = block.next_free_block
            block.prev_free_block = block.next_free_block = None
            block = next_block
        # Splice: the head sentinel now points at the first block not taken.
        assert block is not None
        self._head.next_free_block = block
        block.prev_free_block = self._head
        self.num_free_blocks -= n
        return blocks

    def remove(self, block: KVCacheBlock) -> None:
        """Unlink `block` from wherever it sits in the queue."""
        prev_block, next_block = block.prev_free_block, block.next_free_block
        if prev_block is None or next_block is None:
            raise ValueError(f"block {block.block_id} is not in the free queue")
        prev_block.next_free_block = next_block
        next_block.prev_free_block = prev_block
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        """Put `block` at the tail (reused last)."""
        last = self._tail.prev_free_block
        assert last is not None
        last.next_free_block = block
        block.prev_free_block = last
        block.next_free_block = self._tail
        self._tail.prev_free_block = block
        self.num_free_blocks += 1

    def append_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Put `blocks` at the tail, in the order given."""
        last = self._tail.prev_free_block
        assert last is not None
        count = 0
        for block in blocks:
            last.next_free_block = block
            block.prev_free_block = last
            last = block
            count += 1
        last.next_free_block = self._tail
        self._tail.prev_free_block = last
        self.num_free_blocks += count

    def prepend_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Put `blocks` at the head, keeping their order: `blocks[0]` becomes the head."""
        first = self._head.next_free_block
        assert first is not None
        prev = self._head
        count = 0
        for block in blocks:
            prev.next_free_block = block
            block.prev_free_block = prev
            prev = block
            count += 1
        prev.next_free_block = first
        first.prev_free_block = prev
        self.num_free_blocks += count

    def __iter__(self) -> Iterator[KVCacheBlock]:
        """The free blocks from head to tail (for tests and integrity checks)."""
        block = self._head.next_free_block
        while block is not None and block is not self._tail:
            yield block
            block = block.next_free_block

    def block_ids(self) -> list[int]:
        """The ids of the free blocks from head to tail."""
        return [block.block_id for block in self]
