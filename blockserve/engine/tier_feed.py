"""The engine's side of the KV tiers: building them from the config, telling them which
blocks a step filled, and reporting their state (the tiers themselves live in kv_tiers/)."""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping
from typing import Any

from blockserve.config import CacheConfig
from blockserve.core.cache_types import RequestId
from blockserve.core.events import MEDIUM_REMOTE
from blockserve.core.hashing import BlockHasher, tier_key, untag_extra_keys
from blockserve.engine.outputs import TierStats
from blockserve.kv_tiers.disk import DiskStore
from blockserve.kv_tiers.host import HostStore
from blockserve.kv_tiers.manifest import (
    DiskDirectory,
    Fingerprint,
    model_content_hash,
    open_directory,
)
from blockserve.kv_tiers.offload import KVTiers
from blockserve.kv_tiers.shared import open_shared_store
from blockserve.kv_tiers.store import (
    BlockShape,
    FilledBlock,
    LocalStore,
    SharedStore,
    StoreStats,
    Tier,
)
from blockserve.runner.start import RunnerInfo
from blockserve.sched.output import SchedulerOutput
from blockserve.sched.request import Request

logger = logging.getLogger(__name__)


def create_kv_tiers(
    cache: CacheConfig,
    runner: RunnerInfo,
    hasher: BlockHasher,
    events_hash_format: str | None,
) -> tuple[KVTiers | None, DiskDirectory | None]:
    """The tiers the config asks for (None when none), and the disk directory it holds."""
    arch = runner.arch
    shape = BlockShape(
        num_layers=arch.num_layers,
        block_size=cache.block_size,
        num_kv_heads=arch.num_kv_heads,
        head_dim=arch.head_dim,
        dtype=runner.dtype,
    )
    tiers: list[Tier[LocalStore]] = []
    if cache.kv_offloading_bytes:
        host = HostStore(shape, cache.kv_offloading_bytes, runner.kv.pin_memory)
        tiers.append(Tier("host", "CPU", host))
        logger.info("KV host tier: %.2f GiB of host memory", cache.kv_offloading_size)
    directory = None
    fingerprint = None
    if cache.kv_remote_url or (cache.kv_cache_dir is not None and cache.kv_disk_bytes):
        fingerprint = _fingerprint(runner, cache, hasher)
    if cache.kv_cache_dir is not None and cache.kv_disk_bytes and fingerprint is not None:
        directory = open_directory(
            cache.kv_cache_dir, fingerprint, cache.kv_cache_dir_clear_mismatch
        )
        if directory.usable:
            store = DiskStore(directory.root, shape, cache.kv_disk_bytes)
            found = StoreStats(corrupt=store.damaged_on_open)
            tiers.append(Tier(name="disk", medium="DISK", store=store, stats=found))
            logger.info("KV disk tier: %d blocks held in %s", len(store), directory.root)
    shared: Tier[SharedStore] | None = None
    if cache.kv_remote_url and fingerprint is not None:
        if fingerprint.reusable:
            secret = cache.kv_remote_secret
            secret_bytes = None if secret is None else secret.encode()
            remote = open_shared_store(
                cache.kv_remote_url, shape, fingerprint.namespace(), secret=secret_bytes
            )
            shared = Tier("remote", MEDIUM_REMOTE, remote)
            _log_shared_store(remote)
        else:
            logger.warning(
                "KV remote tier OFF: %s hashes use a random per-process seed (PYTHONHASHSEED "
                "is unset) and would match no other replica's; set PYTHONHASHSEED",
                hasher.algo,
            )
    if not tiers and shared is None:
        return None, directory
    kv_tiers = KVTiers(
        tiers=tiers,
        kv_caches=runner.kv.kv_caches,
        block_size=cache.block_size,
        events_hash_format=events_hash_format,
        on_write=runner.kv.on_write,
        shared=shared,
    )
    return kv_tiers, directory


def _log_shared_store(store: SharedStore) -> None:
    """Whether the shared store answers at start: a store that does not is a miss on every
    lookup until it does, which the start says rather than the first slow request."""
    problem = store.check()
    if problem is None:
        logger.info("KV remote tier: %s answers", store.url)
    else:
        logger.warning(
            "KV remote tier: %s does not answer (%s); every lookup misses until it does "
            "(docs/kv-tiers.md: starting a store)",
            store.url,
            problem,
        )


def _fingerprint(runner: RunnerInfo, cache: CacheConfig, hasher: BlockHasher) -> Fingerprint:
    """What a stored block's bytes depend on (kv_tiers/manifest.py): the disk directory's
    manifest and the remote store's namespace."""
    arch = runner.arch
    return Fingerprint(
        model_hash=model_content_hash(runner.model_dir),
        dtype=str(runner.dtype).removeprefix("torch."),
        block_size=cache.block_size,
        hash_algo=hasher.algo,
        none_hash=hasher.none_hash.hex(),
        num_layers=arch.num_layers,
        num_kv_heads=arch.num_kv_heads,
        head_dim=arch.head_dim,
        reusable=not hasher.random_seed,
    )


def filled_blocks(
    scheduler_output: SchedulerOutput,
    requests: Mapping[RequestId, Request],
    failed: Collection[RequestId],
    block_size: int,
) -> list[FilledBlock]:
    """The full blocks a successful step computed: block i of a request is filled when the
    step's tokens end at or past its last position and start before it."""
    filled = []
    for scheduled in scheduler_output.scheduled:
        request = requests.get(scheduled.request_id)
        if request is None or scheduled.request_id in failed:
            continue
        start = scheduled.num_computed_tokens
        end = start + len(scheduled.token_ids)
        hashes = request.block_hashes
        for index in range(start // block_size, min(end // block_size, len(hashes))):
            tokens = request.all_token_ids[index * block_size : (index + 1) * block_size]
            filled.append(
                FilledBlock(
                    block_id=scheduled.block_ids[index],
                    block_hash=hashes[index],
                    parent_hash=hashes[index - 1] if index else None,
                    token_ids=tuple(tokens),
                    lora_name=request.lora_name,
                    extra_keys=untag_extra_keys(
                        request.hash_keys.extra_keys(index * block_size, (index + 1) * block_size)
                    ),
                    tier_key=None
                    if request.tier_identity is None
                    else tier_key(hashes[index], request.tier_identity),
                )
            )
    return filled


def tier_stats(kv_tiers: KVTiers | None) -> tuple[TierStats, ...]:
    if kv_tiers is None:
        return ()
    # (tier, its capacity, its failures): the shared store is bounded by its server's own
    # settings, and it is the one that can be down.
    rows: list[tuple[Tier[Any], int, int]] = [
        (tier, tier.store.capacity_bytes, 0) for tier in kv_tiers.local
    ]
    if kv_tiers.shared is not None:
        rows.append((kv_tiers.shared, 0, kv_tiers.shared.store.failures))
    result = []
    for tier, capacity, failures in rows:
        loads, seconds = kv_tiers.load_totals(tier)
        result.append(
            TierStats(
                name=tier.name,
                hits=tier.stats.hits,
                stores=tier.stats.stores,
                evictions=tier.stats.evictions,
                corrupt=tier.stats.corrupt,
                used_bytes=tier.store.used_bytes,
                capacity_bytes=capacity,
                loads=loads,
                load_seconds=seconds,
                dropped_writes=kv_tiers.num_dropped_writes,
                misses=tier.stats.misses,
                failures=failures,
            )
        )
    return tuple(result)
