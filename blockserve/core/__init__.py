"""The prefix-cache core: block hashing, the block pool and its free queue, the KV cache
manager, and the KV event structs. Imports no torch.

Modules:

  hashing.py           BlockHash, four algorithms, NONE_HASH seeding, extra keys, BlockHasher,
                       RequestBlockHasher
  free_queue.py        KVCacheBlock, FreeBlockQueue (intrusive doubly-linked list)
  eviction/            which free cached block goes next: EvictionConfig (the policy and tlru's
                       numbers); lru is the free queue itself; base.py: the policy protocol;
                       keyed.py: lfu | priority | tlru; segmented.py: slru | ghost
  block_hash_map.py    the hash → block(s) index
  block_pool.py        BlockPool: null block, ref counts, lazy eviction, integrity check
  kv_cache_manager.py  get_computed_blocks, allocate_slots, free, prefix-cache stats
  cache_types.py       what the manager reads from a request (KVCacheRequest), ComputedBlocks,
                       PrefixCacheStats
  explain.py           CacheExplainer: why a request's prefix match stopped where it did
  miss_ratio.py        MissRatioCurve: LRU reuse distances, exact in a window of recent blocks
                       and SHARDS-sampled beyond it; the hit rate at other cache sizes (fed by
                       the manager on admission and free)
  events.py            msgspec event structs, KVEventRecorder, encode/decode, the in-process
                       CacheListener protocol
"""

from __future__ import annotations

from blockserve.core.block_pool import BlockPool
from blockserve.core.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    KVEventRecorder,
)
from blockserve.core.free_queue import FreeBlockQueue, KVCacheBlock
from blockserve.core.hashing import BlockHash, BlockHasher, BlockKeyInputs, hash_block_tokens
from blockserve.core.kv_cache_manager import ComputedBlocks, KVCacheManager, PrefixCacheStats

__all__ = [
    "AllBlocksCleared",
    "BlockHash",
    "BlockHasher",
    "BlockKeyInputs",
    "BlockPool",
    "BlockRemoved",
    "BlockStored",
    "ComputedBlocks",
    "FreeBlockQueue",
    "KVCacheBlock",
    "KVCacheManager",
    "KVEventBatch",
    "KVEventRecorder",
    "PrefixCacheStats",
    "hash_block_tokens",
]
