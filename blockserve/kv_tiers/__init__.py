"""Stores below the device KV cache (host memory, disk), keyed by the block hash.

Modules:

  store.py        BlockStore protocol, BlockShape, StoreStats, Tier, FilledBlock, the
                  checksummed record of a stored block
  host.py         HostStore: host memory (pinned with CUDA), bytes-bounded LRU
  disk.py         DiskStore: one checksummed file per block, written by rename, LRU order kept
                  in file times across restarts
  manifest.py     the disk directory's fingerprint, lock and warm-restart rules
  remote.py       RemoteStore: a Redis-protocol store every replica shares, namespaced by the
                  fingerprint, marked down and retried with backoff on faults
  offload.py      KVTiers: writer and loader threads, lookup host → disk → remote
  tier_events.py  the tiers' KV events, one recorder per local tier
"""

from blockserve.kv_tiers.disk import DiskStore
from blockserve.kv_tiers.host import HostStore
from blockserve.kv_tiers.store import BlockShape, BlockStore, StoreStats

__all__ = ["BlockShape", "BlockStore", "DiskStore", "HostStore", "StoreStats"]
