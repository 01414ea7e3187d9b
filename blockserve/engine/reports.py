"""The engine core's reports on its KV cache, read between steps: the pool's occupancy and
integrity, and the online miss-ratio curve at sizes around this cache's. Read-only."""

from __future__ import annotations

from blockserve.core.kv_cache_manager import KVCacheManager
from blockserve.core.miss_ratio import MissRatioCurve
from blockserve.engine.outputs import KVCacheReport, MissRatioPoint, MissRatioReport


def kv_cache_report(manager: KVCacheManager) -> KVCacheReport:
    pool = manager.block_pool
    return KVCacheReport(
        num_blocks=pool.num_blocks,
        num_free_blocks=pool.num_free_blocks,
        usage=pool.usage,
        num_cached_hashes=len(pool.cached_block_hash_to_block),
        num_requests_holding_blocks=len(manager.req_to_blocks),
        integrity_errors=tuple(manager.integrity_errors()),
    )


def miss_ratio_report(manager: KVCacheManager, curve: MissRatioCurve | None) -> MissRatioReport:
    """The curve at 17 sizes, 1/16x to 16x this cache in steps of sqrt(2) (no points when
    there is no curve: prefix caching off, or `--miss-ratio-samples 0`)."""
    usable = manager.block_pool.num_usable_blocks
    block_size = manager.block_size
    points: tuple[MissRatioPoint, ...] = ()
    if curve is not None:
        capacities = sorted({max(1, round(usable * 2.0 ** (k / 2))) for k in range(-8, 9)})
        points = tuple(
            MissRatioPoint(capacity, capacity * block_size, round(rate, 5))
            for capacity, rate in curve.curve(capacities)
        )
    return MissRatioReport(
        block_size=block_size,
        num_blocks=usable,
        actual_hit_rate=round(manager.prefix_cache_stats.hit_rate, 5),
        num_requests=manager.prefix_cache_stats.requests,
        sampling_rate=curve.sampling_rate if curve is not None else 0.0,
        num_tracked_hashes=curve.num_tracked if curve is not None else 0,
        points=points,
    )
