"""`BlockHashToBlockMap`, the prefix cache's index.

Owns only the mapping from hash to block(s); the block pool decides when entries come and go
and emits the events. Must not touch reference counts or the free queue.
"""

from __future__ import annotations

from collections.abc import Iterator

from blockserve.core.free_queue import KVCacheBlock
from blockserve.core.hashing import BlockHash


class BlockHashToBlockMap:
    """The prefix-cache index: block hash → the physical block(s) holding that content.

    One hash can map to several physical blocks: a block recomputed because the last prompt
    token is never a hit is cached again under the same hash. The common single-block case is
    stored without an inner dict.
    """

    __slots__ = ("_map",)

    def __init__(self) -> None:
        self._map: dict[BlockHash, KVCacheBlock | dict[int, KVCacheBlock]] = {}

    def __len__(self) -> int:
        return len(self._map)

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._map

    def get_one_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        """A block holding `block_hash`, or None when the hash is not cached."""
        entry = self._map.get(block_hash)
        if entry is None or isinstance(entry, KVCacheBlock):
            return entry
        return next(iter(entry.values()))

    def insert(self, block_hash: BlockHash, block: KVCacheBlock) -> None:
        entry = self._map.get(block_hash)
        if entry is None:
            self._map[block_hash] = block
        elif isinstance(entry, KVCacheBlock):
            self._map[block_hash] = {entry.block_id: entry, block.block_id: block}
        else:
            entry[block.block_id] = block

    def pop(self, block_hash: BlockHash, block_id: int) -> bool:
        """Unmap one block; True when no block holds `block_hash` any more."""
        entry = self._map[block_hash]
        if isinstance(entry, KVCacheBlock):
            assert entry.block_id == block_id, "hash map entry points at another block"
            del self._map[block_hash]
            return True
        del entry[block_id]
        if len(entry) == 1:
            self._map[block_hash] = next(iter(entry.values()))
        return False

    def clear(self) -> None:
        self._map.clear()

    def items(self) -> Iterator[tuple[BlockHash, KVCacheBlock]]:
        """Every (hash, block) pair, one per physical block."""
        for block_hash, entry in self._map.items():
            if isinstance(entry, KVCacheBlock):
                yield block_hash, entry
            else:
                for block in entry.values():
                    yield block_hash, block

    def hashes(self) -> set[BlockHash]:
        """The set of cached hashes."""
        return set(self._map)
