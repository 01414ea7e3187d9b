"""`blockserve replay` (and `blockserve bench replay`): a request trace replayed through the real
block pool, per eviction policy and capacity, per tier, or per replica count and router."""

from __future__ import annotations

import argparse
from pathlib import Path

from blockserve.cluster.policies import DEFAULT_PREFIX_WEIGHT
from blockserve.cluster.policies import POLICIES as ROUTERS
from blockserve.core.eviction import EVICTION_POLICIES
from blockserve.errors import InvalidConfigError
from blockserve.replay.report import DEFAULT_CAPACITIES


def add_replay_arguments(replay: argparse.ArgumentParser) -> None:
    replay.add_argument("trace", help="the trace file (JSONL)")
    replay.add_argument(
        "--capacities",
        default=",".join(str(c) for c in DEFAULT_CAPACITIES),
        help="comma-separated cache sizes (default in blocks; see --capacity-unit)",
    )
    replay.add_argument("--capacity-unit", choices=["blocks", "tokens"], default="blocks")
    replay.add_argument(
        "--eviction-policy",
        "--policies",
        dest="policies",
        default=",".join(EVICTION_POLICIES),
        help=f"comma-separated eviction policies (default: {','.join(EVICTION_POLICIES)})",
    )
    replay.add_argument(
        "--trace-block-size", type=int, default=512, help="tokens per trace hash id"
    )
    replay.add_argument(
        "--out-dir",
        default=None,
        help="where replay.json and replay.png go (default: a new folder under the system's "
        "temporary directory, printed at the end)",
    )
    replay.add_argument(
        "--tiers",
        default=None,
        help="device=N,host=M,disk=K (blocks): replay the device tier (each --eviction-policy) "
        "over LRU host and disk tiers written through, and report each tier's hit rate instead "
        "of the capacity sweep",
    )
    replay.add_argument(
        "--replicas",
        default=None,
        help="comma-separated replica counts (e.g. 1,4,16,64): replay a cluster of that many "
        "pools of the first --capacities each, behind each --router, instead of the sweep",
    )
    replay.add_argument(
        "--router",
        default=",".join(ROUTERS),
        help=f"with --replicas: comma-separated routers (default: {','.join(ROUTERS)})",
    )
    replay.add_argument(
        "--router-prefix-weight",
        type=float,
        default=DEFAULT_PREFIX_WEIGHT,
        help="with --replicas: the kv router's weight, as `serve --router-prefix-weight`",
    )
    replay.add_argument("--no-progress", action="store_true", help="no progress bar")


def run_replay(args: argparse.Namespace) -> int:
    import tempfile

    from blockserve.replay.report import PLOTS_NEED, format_table, run_lab, write_reports
    from blockserve.replay.trace import load_trace

    block_size = args.trace_block_size
    if block_size < 1:
        raise InvalidConfigError("--trace-block-size must be a positive integer")
    try:
        values = [int(v) for v in args.capacities.split(",") if v.strip()]
    except ValueError:
        raise InvalidConfigError(f"--capacities must be integers: {args.capacities!r}") from None
    capacities = [v // block_size if args.capacity_unit == "tokens" else v for v in values]
    if not capacities or min(capacities) < 1:
        raise InvalidConfigError("every capacity must be at least one block")
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    unknown = [p for p in policies if p not in EVICTION_POLICIES]
    if unknown:
        raise InvalidConfigError(f"unknown eviction policies: {', '.join(unknown)}")
    trace = load_trace(args.trace)
    out_dir = Path(args.out_dir or tempfile.mkdtemp(prefix="blockserve-replay-"))
    if args.replicas is not None:
        return _run_cluster_replay(args, trace, capacities[0], out_dir)
    if args.tiers is not None:
        from blockserve.replay.tier_sim import (
            format_tier_table,
            parse_tiers,
            run_tiers,
            write_tier_report,
        )

        tiered, infinite = run_tiers(trace, parse_tiers(args.tiers), policies, block_size)
        print(format_tier_table(tiered, infinite))
        path = write_tier_report(tiered, infinite, out_dir, args.trace, block_size)
        print(f"wrote {path}")
        return 0
    results = run_lab(trace, capacities, policies, block_size, progress=not args.no_progress)
    print(format_table(results, block_size))
    json_path, png_path = write_reports(results, out_dir, args.trace, block_size)
    print(f"wrote {json_path} and {png_path}" if png_path else f"wrote {json_path} ({PLOTS_NEED})")
    return 0


def _run_cluster_replay(args: argparse.Namespace, trace: list, capacity: int, out_dir: Path) -> int:
    from blockserve.replay.cluster_report import (
        format_cluster_table,
        run_cluster_lab,
        write_cluster_report,
    )
    from blockserve.replay.cluster_sim import ServiceModel

    try:
        counts = [int(v) for v in args.replicas.split(",") if v.strip()]
    except ValueError:
        raise InvalidConfigError(f"--replicas must be integers: {args.replicas!r}") from None
    routers = [r.strip() for r in args.router.split(",") if r.strip()]
    unknown = [r for r in routers if r not in ROUTERS]
    if not counts or min(counts) < 1 or not routers or unknown:
        raise InvalidConfigError(
            f"--replicas takes counts >= 1 and --router names from {', '.join(ROUTERS)}"
        )
    if args.router_prefix_weight < 0:
        raise InvalidConfigError("--router-prefix-weight must be >= 0")
    service = ServiceModel()
    results = run_cluster_lab(
        trace, counts, routers, capacity, args.trace_block_size, service, args.router_prefix_weight
    )
    print(format_cluster_table(results, args.trace_block_size))
    print(f"wrote {write_cluster_report(results, out_dir, args.trace, service)}")
    return 0
