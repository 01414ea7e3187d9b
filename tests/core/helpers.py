"""Shared helpers of the core tests: tiny worlds, admission as the scheduler does it, and the
integrity checks run after every pool and manager test."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from blockserve.core.block_pool import BlockPool
from blockserve.core.events import KVEventRecorder
from blockserve.core.hashing import BlockHasher, RequestBlockHasher
from blockserve.core.kv_cache_manager import KVCacheManager
from blockserve.sched.request import Request


def assert_pool_integrity(pool: BlockPool) -> None:
    """Every block is free with ref_cnt 0 or held; the hash map and the block hashes agree."""
    free_ids = pool.free_block_queue.block_ids()
    assert len(free_ids) == len(set(free_ids)) == pool.num_free_blocks
    free = set(free_ids)
    null = pool.null_block
    assert null.block_id == 0 and null.is_null and null.block_hash is None
    assert 0 not in free
    for block in pool.blocks[1:]:
        assert not block.is_null
        if block.block_id in free:
            assert block.ref_cnt == 0, f"free block {block.block_id} has ref_cnt {block.ref_cnt}"
        else:
            assert block.ref_cnt > 0, f"block {block.block_id} is neither free nor held"
    mapped: dict[int, bytes] = {}
    for block_hash, block in pool.cached_block_hash_to_block.items():
        assert block.block_hash == block_hash
        assert block.block_id not in mapped
        mapped[block.block_id] = block_hash
    hashed = {b.block_id: b.block_hash for b in pool.blocks if b.block_hash is not None}
    assert mapped == hashed


def assert_manager_integrity(manager: KVCacheManager) -> None:
    """Pool integrity, and every block's ref_cnt equals the number of requests holding it."""
    pool = manager.block_pool
    assert_pool_integrity(pool)
    holders = Counter(
        block.block_id for blocks in manager.req_to_blocks.values() for block in blocks
    )
    for block in pool.blocks[1:]:
        assert block.ref_cnt == holders.get(block.block_id, 0), f"block {block.block_id}"
    assert set(manager.num_cached_blocks) == set(manager.req_to_blocks)


HASHER = BlockHasher("sha256")


def make_manager(num_blocks: int = 11, block_size: int = 4, caching: bool = True) -> KVCacheManager:
    """A small manager with KV events on (hashes as uint64, as on the wire)."""
    return KVCacheManager(num_blocks, block_size, caching, KVEventRecorder())


def make_request(request_id: str, token_ids: Sequence[int], block_size: int = 4) -> Request:
    return Request(request_id, list(token_ids), block_hasher=RequestBlockHasher(HASHER, block_size))


def admit(manager: KVCacheManager, request: Request, num_tokens: int | None = None) -> int | None:
    """Look the request up and allocate its first chunk, as the scheduler does on admission.

    Returns the hit tokens, or None when the allocation did not fit (nothing changed then).
    `num_tokens` is the chunk to compute (default: the whole remaining prompt).
    """
    hit_blocks, num_hits = manager.get_computed_blocks(request)
    num_new = (request.num_tokens - num_hits) if num_tokens is None else num_tokens
    if manager.allocate_slots(request, num_new, num_hits, hit_blocks) is None:
        return None
    request.num_computed_tokens = num_hits + num_new
    return num_hits


def uint64(block_hash: bytes) -> int:
    return int.from_bytes(block_hash[-8:], "big")
