"""The prefix-cache index: one hash may map to several physical blocks."""

from __future__ import annotations

from blockserve.core.block_hash_map import BlockHashToBlockMap
from blockserve.core.free_queue import KVCacheBlock
from blockserve.core.hashing import BlockHash

H1, H2 = BlockHash(b"h1"), BlockHash(b"h2")


def test_a_hash_held_by_two_blocks_goes_only_with_the_last() -> None:
    """A recomputed block cached under the same hash joins the entry; popping one of two
    keeps the hash, popping the last removes it."""
    index = BlockHashToBlockMap()
    first, second, other = KVCacheBlock(1), KVCacheBlock(2), KVCacheBlock(3)
    index.insert(H1, first)
    index.insert(H1, second)
    index.insert(H2, other)
    assert (len(index), index.hashes()) == (2, {H1, H2})
    assert sorted((h, b.block_id) for h, b in index.items()) == [(H1, 1), (H1, 2), (H2, 3)]
    assert index.pop(H1, 1) is False
    assert index.get_one_block(H1) is second
    assert index.pop(H1, 2) is True
    assert H1 not in index and index.get_one_block(H1) is None


def test_clear_empties_the_index() -> None:
    """After clear no hash is found."""
    index = BlockHashToBlockMap()
    index.insert(H1, KVCacheBlock(1))
    index.clear()
    assert (len(index), index.get_one_block(H1)) == (0, None)
