"""Replaying a trace through a device tier and LRU tiers below it: the hit rate of each."""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from blockserve.core.eviction import EvictionConfig
from blockserve.core.hashing import BlockHash
from blockserve.core.kv_cache_manager import KVCacheManager
from blockserve.errors import InvalidConfigError
from blockserve.replay.simulate import (
    ReplayRequest,
    ReplayResult,
    replay_infinite,
    run_request,
)
from blockserve.replay.trace import BlockLayout, TraceRequest, block_layouts

# The device tier is the real `KVCacheManager` under a chosen eviction policy, as in simulate.py.
# Below it, host and disk tiers are LRU sets of block hashes of a fixed capacity, written through:
# every block a request holds is copied down to each tier as it is cached (a block a tier already
# holds is only refreshed). A lookup takes the device's leading hits, then continues block by
# block in the lower tiers (host first) for as long as one of them holds the next hash; those
# blocks are loaded into the device, where they become ordinary cached blocks. The hit rule is the
# device's: at most `(input_length - 1) // B` leading blocks.
#
# It models the tier design (the same keys in every tier, a lookup that continues past the
# device's last hit, a device whose eviction order the tiers never change) on hashes alone, moving
# no KV.

TIER_NAMES = ("device", "host", "disk")


@dataclass(frozen=True, slots=True)
class TierReplayResult:
    policy: str  # the device tier's eviction policy
    capacities: dict[str, int]  # blocks per tier; a tier of 0 is absent
    num_requests: int
    num_skipped: int
    query_tokens: int
    hit_tokens: dict[str, int]  # per tier

    def hit_rate(self, tier: str) -> float:
        return self.hit_tokens[tier] / self.query_tokens if self.query_tokens else 0.0

    @property
    def total_hit_rate(self) -> float:
        return sum(self.hit_tokens.values()) / self.query_tokens if self.query_tokens else 0.0


def parse_tiers(text: str) -> dict[str, int]:
    """`device=N,host=M,disk=K` (host and disk optional) → capacities in blocks."""
    capacities = dict.fromkeys(TIER_NAMES, 0)
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, value = part.partition("=")
        if name not in TIER_NAMES or not value.strip().isdigit():
            raise InvalidConfigError(f"--tiers takes device=N,host=M,disk=K (blocks), got {part!r}")
        capacities[name] = int(value)
    if capacities["device"] < 1:
        raise InvalidConfigError("--tiers needs device=N with N at least 1 block")
    return capacities


class _LruTier:
    """The hashes one lower tier holds, least recently used first."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._hashes: OrderedDict[BlockHash, None] = OrderedDict()

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self._hashes

    def touch(self, block_hash: BlockHash) -> None:
        self._hashes.move_to_end(block_hash)

    def store(self, block_hash: BlockHash) -> None:
        if block_hash in self._hashes:
            self._hashes.move_to_end(block_hash)
            return
        if self.capacity == 0:
            return
        if len(self._hashes) >= self.capacity:
            self._hashes.popitem(last=False)
        self._hashes[block_hash] = None


def replay_tiers(
    trace: Sequence[TraceRequest],
    layouts: Sequence[BlockLayout],
    capacities: dict[str, int],
    policy: str,
    block_size: int,
) -> TierReplayResult:
    """Hit tokens per tier over the trace (requests one at a time, as in simulate.py)."""
    device = capacities["device"]
    manager = KVCacheManager(
        num_blocks=device + 1,
        block_size=block_size,
        enable_caching=True,
        events=None,
        eviction=EvictionConfig(policy),
    )
    lower = {name: _LruTier(capacities[name]) for name in TIER_NAMES[1:]}
    hits = dict.fromkeys(TIER_NAMES, 0)
    query_tokens = skipped = 0
    for index, (request, layout) in enumerate(zip(trace, layouts, strict=True)):
        if layout.num_blocks > device:
            skipped += 1
            continue
        replayed = ReplayRequest(
            str(index), layout.block_hashes, request.input_length, lora_name=request.lora_name
        )
        device_blocks, num_device_hits = manager.get_computed_blocks(replayed)
        position = num_device_hits // block_size
        hits["device"] += position
        while position < layout.num_hittable_blocks:
            block_hash = layout.block_hashes[position]
            holder = next((name for name, t in lower.items() if block_hash in t), None)
            if holder is None:
                break
            lower[holder].touch(block_hash)
            hits[holder] += 1
            position += 1
        # The tiers' blocks are loaded, not computed, but land in the device the same way.
        run_request(manager, replayed, request, device_blocks, num_device_hits)
        for tier in lower.values():  # written through as the blocks are cached
            for block_hash in layout.block_hashes:
                tier.store(block_hash)
        query_tokens += request.input_length
    return TierReplayResult(
        policy=policy,
        capacities=dict(capacities),
        num_requests=len(trace),
        num_skipped=skipped,
        query_tokens=query_tokens,
        hit_tokens={name: blocks * block_size for name, blocks in hits.items()},
    )


def run_tiers(
    trace: Sequence[TraceRequest],
    capacities: dict[str, int],
    policies: Sequence[str],
    block_size: int,
) -> tuple[list[TierReplayResult], ReplayResult]:
    """The tiered replay under each device policy, and the infinite bound (skipping the
    same requests: those larger than the device tier)."""
    layouts = block_layouts(trace, block_size)
    results = [replay_tiers(trace, layouts, capacities, p, block_size) for p in policies]
    return results, replay_infinite(trace, layouts, block_size, capacities["device"])


def format_tier_table(results: Sequence[TierReplayResult], infinite: ReplayResult) -> str:
    """Token hit rate per tier and in total, per device policy, beside the infinite bound."""
    sizes = ", ".join(f"{name} {results[0].capacities[name]}" for name in TIER_NAMES)
    header = ["device policy", *(f"{t} hit%" for t in TIER_NAMES), "total hit%", "infinite hit%"]
    rows = [header]
    for result in results:
        rates = [result.hit_rate(t) for t in TIER_NAMES] + [result.total_hit_rate]
        rows.append(
            [
                result.policy,
                *(f"{100 * r:.2f}" for r in rates),
                f"{100 * infinite.token_hit_rate:.2f}",
            ]
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = [f"tiers (blocks): {sizes}"]
    lines += ["  ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True)) for row in rows]
    return "\n".join(lines)


def write_tier_report(
    results: Sequence[TierReplayResult],
    infinite: ReplayResult,
    out_dir: Path,
    trace_path: str,
    block_size: int,
) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "tiers.json"
    body = {
        "trace": Path(trace_path).name,
        "block_size": block_size,
        "infinite_token_hit_rate": round(infinite.token_hit_rate, 5),
        "results": [
            {
                **asdict(r),
                "hit_rates": {t: round(r.hit_rate(t), 5) for t in TIER_NAMES},
                "total_hit_rate": round(r.total_hit_rate, 5),
            }
            for r in results
        ],
    }
    path.write_text(json.dumps(body, indent=2) + "\n")
    return path
