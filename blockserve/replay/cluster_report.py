"""Running the cluster replay for several replica counts and routers; table and JSON."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

from blockserve.cluster.policies import DEFAULT_PREFIX_WEIGHT, make_policy
from blockserve.replay.cluster_sim import (
    DEFAULT_SERVICE,
    ClusterReplayResult,
    ClusterShape,
    ServiceModel,
    replay_cluster,
)
from blockserve.replay.trace import TraceRequest, block_layouts


def run_cluster_lab(
    trace: Sequence[TraceRequest],
    replica_counts: Sequence[int],
    routers: Sequence[str],
    capacity: int,
    block_size: int,
    service: ServiceModel = DEFAULT_SERVICE,
    prefix_weight: float = DEFAULT_PREFIX_WEIGHT,
) -> list[ClusterReplayResult]:
    """Every router at every replica count (at one replica the routers agree: one run)."""
    layouts = block_layouts(trace, block_size)
    results = []
    for num_replicas in replica_counts:
        for router in routers if num_replicas > 1 else routers[:1]:
            policy = make_policy(router, capacity, prefix_weight, seed=0)
            shape = ClusterShape(num_replicas, capacity, block_size)
            results.append(replay_cluster(trace, layouts, policy, shape, service))
    return results


def format_cluster_table(results: Sequence[ClusterReplayResult], block_size: int) -> str:
    header = (
        f"{'replicas':>8} {'router':<12} {'hit rate':>8} {'imbalance':>9} "
        f"{'TTFT p50':>9} {'TTFT p90':>9} {'route us':>8}"
    )
    lines = [
        f"{block_size}-token blocks, {results[0].capacity_blocks} blocks per replica; "
        "imbalance = max/mean prompt tokens computed per replica; TTFT simulated",
        header,
    ]
    for r in results:
        lines.append(
            f"{r.num_replicas:>8} {r.router:<12} {r.token_hit_rate:>8.2%} "
            f"{r.load_imbalance:>9.3f} {r.ttft_p50_s:>8.2f}s {r.ttft_p90_s:>8.2f}s "
            f"{r.route_us_per_request:>8.1f}"
        )
    return "\n".join(lines)


def write_cluster_report(
    results: Sequence[ClusterReplayResult],
    out_dir: Path,
    trace_path: str,
    service: ServiceModel,
) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    for r in results:
        row = asdict(r)
        row.update(
            token_hit_rate=round(r.token_hit_rate, 5),
            load_imbalance=round(r.load_imbalance, 4),
            route_us_per_request=round(r.route_us_per_request, 2),
        )
        rows.append(row)
    path = out_dir / "replay_cluster.json"
    report = {"trace": trace_path, "service_model": asdict(service), "results": rows}
    path.write_text(json.dumps(report, indent=2) + "\n")
    return path
