"""The prefix-cache core: block hashing, the block pool and its free queue, the KV cache
manager, and the KV event structs. Imports no torch."""

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
