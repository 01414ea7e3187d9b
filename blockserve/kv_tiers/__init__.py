"""Stores below the device KV cache (host memory, disk), keyed by the block hash."""

from blockserve.kv_tiers.disk import DiskStore
from blockserve.kv_tiers.host import HostStore
from blockserve.kv_tiers.store import BlockShape, BlockStore, StoreStats

__all__ = ["BlockShape", "BlockStore", "DiskStore", "HostStore", "StoreStats"]
