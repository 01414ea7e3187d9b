"""The KV-tier options of `EngineArgs` (host memory, disk, a shared remote store), declared
apart: `EngineArgs` inherits them. Imports no torch."""

from __future__ import annotations

from dataclasses import dataclass

from blockserve.engine import arg_checks
from blockserve.options import option


@dataclass(frozen=True)  # no slots: a second base of EngineArgs beside LoRAArgs' slots
class KVTierArgs:
    """The tiers below the device KV cache (docs/kv-tiers.md)."""

    kv_offloading_size: float = option(
        0.0,
        "GiB of host memory for a KV tier below the device cache (vLLM's flag); blocks "
        "evicted from the device come back from it instead of being recomputed. Rarely "
        "useful on a CPU device (docs/kv-tiers.md); 0: off",
        check=arg_checks.finite_non_negative,
    )
    kv_cache_dir: str | None = option(
        None,
        "a directory for a disk KV tier: blocks are written there as they are computed and "
        "served from there after eviction and after a restart (docs/kv-tiers.md)",
    )
    kv_disk_size: float = option(
        16.0,
        "GiB the disk KV tier may hold (with --kv-cache-dir)",
        check=arg_checks.finite_non_negative,
    )
    kv_cache_dir_clear_mismatch: bool = option(
        False,
        "empty a --kv-cache-dir written for another model or cache setup instead of leaving "
        "it alone and running without the disk tier",
    )
    kv_remote_url: str | None = option(
        None,
        "a Redis-protocol store (redis://[user:password@]host:port/db, rediss:// for TLS; "
        "Valkey too) as a KV tier below host and disk that every replica shares; the store "
        "bounds and evicts itself (docs/kv-tiers.md)",
        check=arg_checks.redis_url,
    )
    kv_remote_secret: str | None = option(
        None,
        "a secret every replica shares: records in --kv-remote-url are signed with it "
        "(HMAC-SHA256 over namespace, key and value) and a record that fails is a miss, "
        "deleted; without it whoever can write the store is trusted (default: "
        "BLOCKSERVE_KV_REMOTE_SECRET, if set)",
        check=arg_checks.non_empty_or_none,
        secret=True,
    )
