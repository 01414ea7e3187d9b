"""Command-line entry point: `blockserve serve` and the tools around it.

Parses flags (vLLM's names where vLLM has one) into configs and hands them to library code;
holds no logic a library user would need.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from blockserve import __version__
from blockserve.cluster.config import ClusterConfig
from blockserve.cluster.policies import DEFAULT_PREFIX_WEIGHT
from blockserve.cluster.policies import POLICIES as ROUTERS
from blockserve.config import ServerConfig
from blockserve.core.eviction import EVICTION_POLICIES
from blockserve.engine.args import EngineArgs
from blockserve.errors import BlockserveError, InvalidConfigError
from blockserve.options import add_arguments, from_namespace
from blockserve.replay.report import DEFAULT_CAPACITIES


def _add_serve_parser(subparsers: argparse._SubParsersAction) -> None:
    serve = subparsers.add_parser(
        "serve",
        help="serve a model over an OpenAI-compatible HTTP API",
        description="Serve a model over an OpenAI-compatible HTTP API.",
    )
    serve.add_argument(
        "model_tag",
        nargs="?",
        metavar="MODEL",
        help="the model, as --model (vLLM's positional form); give one or the other",
    )
    add_arguments(serve, ServerConfig)
    EngineArgs.add_cli_args(serve)
    add_arguments(serve, ClusterConfig)


def _add_events_parser(subparsers: argparse._SubParsersAction) -> None:
    events = subparsers.add_parser(
        "events",
        help="print a server's KV events (BlockStored / BlockRemoved / AllBlocksCleared)",
        description="Subscribe to a KV event stream and print one line per event; missed "
        "batches are fetched through the replay endpoint when one is given.",
    )
    events.add_argument("--endpoint", default="tcp://127.0.0.1:5557", help="the PUB endpoint")
    events.add_argument("--replay-endpoint", default=None, help="the ROUTER replay endpoint")
    events.add_argument("--topic", default="", help="topic prefix to subscribe to")
    events.add_argument("--json", action="store_true", help="print JSON lines")
    events.add_argument(
        "--max-events", type=int, default=None, help="exit after printing this many events"
    )


def run_events(args: argparse.Namespace) -> int:
    from blockserve.events.subscriber import KVEventSubscriber, format_event

    subscriber = KVEventSubscriber(args.endpoint, args.replay_endpoint, args.topic)
    remaining = args.max_events
    try:
        while remaining is None or remaining > 0:
            for seq, batch in subscriber.poll(timeout_ms=200):
                for event in batch.events[:remaining]:
                    print(format_event(seq, batch, event, args.json), flush=True)
                if remaining is not None:
                    remaining -= min(remaining, len(batch.events))
                    if remaining == 0:
                        break
    except KeyboardInterrupt:
        pass
    finally:
        subscriber.close()
    return 0


def _add_replay_parser(subparsers: argparse._SubParsersAction) -> None:
    replay = subparsers.add_parser(
        "replay",
        help="replay a request trace through the real block pool, per policy and capacity",
        description="Replay a Mooncake-format trace (JSONL: timestamp, input_length, "
        "output_length, hash_ids) through the real KV cache manager and report hit rates "
        "beside an infinite cache and Belady's offline optimum.",
    )
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

    from blockserve.replay.report import format_table, run_lab, write_reports
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
        from blockserve.replay.tiers import (
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
    print(f"wrote {json_path} and {png_path}")
    return 0


def _run_cluster_replay(args: argparse.Namespace, trace: list, capacity: int, out_dir: Path) -> int:
    from blockserve.replay.cluster import ServiceModel
    from blockserve.replay.cluster_report import (
        format_cluster_table,
        run_cluster_lab,
        write_cluster_report,
    )

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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="blockserve",
        description="blockserve: LLM serving around a hashed-block prefix cache.",
    )
    parser.add_argument("--version", action="version", version=f"blockserve {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    _add_serve_parser(subparsers)
    _add_events_parser(subparsers)
    _add_replay_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        if args.command == "serve":
            return run_serve(args)
        if args.command == "events":
            return run_events(args)
        if args.command == "replay":
            return run_replay(args)
    except BlockserveError as exc:
        print(f"blockserve {args.command}: {exc}", file=sys.stderr)
        return 2
    parser.error(f"unknown command {args.command!r}")
    return 2


def run_serve(args: argparse.Namespace) -> int:
    """Build the configs from the flags and serve (imports torch only now)."""
    from blockserve.server.auth import resolve_api_keys
    from blockserve.server.serve import serve

    if args.model_tag is not None:
        if args.model is not None and args.model != args.model_tag:
            raise InvalidConfigError(
                f"two models given: {args.model_tag!r} (positional) and {args.model!r} (--model)"
            )
        args.model = args.model_tag

    engine_args = EngineArgs.from_cli_args(args)
    server_config = resolve_api_keys(from_namespace(ServerConfig, args), os.environ)
    cluster = from_namespace(ClusterConfig, args)
    if cluster.replicas > 0:
        from blockserve.cluster.launch import serve_cluster

        return serve_cluster(engine_args, server_config, cluster)
    return serve(engine_args.create_configs(), server_config)


if __name__ == "__main__":
    sys.exit(main())
