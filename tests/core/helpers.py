"""Shared helpers of the core tests: tiny worlds, admission as the scheduler does it, and the
integrity checks run after every pool and manager test."""

from __future__ import annotations

from collections.abc import Sequence

from blockserve.core.block_pool import BlockPool
from blockserve.core.events import KVEventRecorder
from blockserve.core.eviction import EvictionConfig, TailLRUConfig
from blockserve.core.hashing import BlockHasher, RequestBlockHasher
from blockserve.core.kv_cache_manager import KVCacheManager
from blockserve.sched.request import Request


def assert_pool_integrity(pool: BlockPool) -> None:
    """Every block is free with ref_cnt 0 or held; the hash map and the block hashes agree."""
    assert pool.integrity_errors() == []


def assert_manager_integrity(manager: KVCacheManager) -> None:
    """Pool integrity, and every block's ref_cnt equals the number of requests holding it."""
    assert manager.integrity_errors() == []


HASHER = BlockHasher("sha256")


def make_manager(
    num_blocks: int = 11,
    block_size: int = 4,
    caching: bool = True,
    policy: str = "lru",
    tlru: TailLRUConfig | None = None,
) -> KVCacheManager:
    """A small manager with KV events on (hashes as uint64, as on the wire)."""
    eviction = EvictionConfig(policy, tlru or TailLRUConfig())
    return KVCacheManager(num_blocks, block_size, caching, KVEventRecorder(), eviction)


def make_request(
    request_id: str, token_ids: Sequence[int], block_size: int = 4, priority: int = 0
) -> Request:
    hasher = RequestBlockHasher(HASHER, block_size)
    return Request(request_id, list(token_ids), block_hasher=hasher, priority=priority)


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
