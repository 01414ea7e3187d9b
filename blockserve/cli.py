"""Command-line entry point: `blockserve serve` and the tools around it.

Parses flags (vLLM's names where vLLM has one) into configs and hands them to library code;
holds no logic a library user would need.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from collections.abc import Sequence

from blockserve import __version__
from blockserve.bench.cli import add_bench_parser, run_bench
from blockserve.cluster.config import ClusterConfig
from blockserve.engine.args import EngineArgs
from blockserve.errors import BlockserveError, InvalidConfigError
from blockserve.options import add_arguments, from_namespace
from blockserve.replay.command import add_replay_arguments, run_replay
from blockserve.server.options import ServerConfig, with_vllm_environment
from blockserve.server.vllm_surface import unsupported_flag


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
    events.add_argument(
        "--hint-after",
        type=float,
        default=10.0,
        help="seconds without any event before saying what a server needs to publish them",
    )


def run_events(args: argparse.Namespace) -> int:
    from blockserve.events.subscriber import KVEventSubscriber, format_event

    subscriber = KVEventSubscriber(args.endpoint, args.replay_endpoint, args.topic)
    remaining = args.max_events
    hint_at = time.monotonic() + args.hint_after  # until the first batch arrives
    try:
        while remaining is None or remaining > 0:
            batches = subscriber.poll(timeout_ms=200)
            if batches:
                hint_at = math.inf
            elif time.monotonic() > hint_at:
                print(events_hint(args.endpoint, args.hint_after), file=sys.stderr, flush=True)
                hint_at = math.inf
            for seq, batch in batches:
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


def events_hint(endpoint: str, waited_s: float) -> str:
    """What `blockserve events` prints when nothing arrives: servers publish only when asked."""
    port = endpoint.rsplit(":", 1)[-1]
    config = f'{{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:{port}"}}'
    return (
        f"blockserve events: no KV events from {endpoint} in {waited_s:g} s; a server "
        f"publishes them only when started with --kv-events-config '{config}'. The * makes "
        "the server bind and listen for subscribers; an endpoint naming a host instead makes "
        "its publisher connect to that address (vLLM's rule), where nothing listens unless "
        "a subscriber binds it"
    )


def _add_replay_parser(subparsers: argparse._SubParsersAction) -> None:
    replay = subparsers.add_parser(
        "replay",
        help="replay a request trace through the real block pool, per policy and capacity",
        description="Replay a Mooncake-format trace (JSONL: timestamp, input_length, "
        "output_length, hash_ids) through the real KV cache manager and report hit rates "
        "beside an infinite cache and Belady's offline optimum.",
    )
    add_replay_arguments(replay)


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
    add_bench_parser(subparsers)
    return parser


def _subparser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    (subparsers,) = (a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return subparsers.choices[name]


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)  # `bench vs-vllm` hands its flags on
    if extra and args.command == "serve":
        for token in extra:  # one of vLLM's flags is named as such, with serve's usage
            if (message := unsupported_flag(token)) is not None:
                _subparser(parser, "serve").error(message)
    if extra and getattr(args, "bench", None) != "vs-vllm":
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.race_args = extra
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
        if args.command == "bench":
            return run_bench(args)
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
    server_config = with_vllm_environment(
        resolve_api_keys(from_namespace(ServerConfig, args), os.environ), os.environ
    )
    cluster = from_namespace(ClusterConfig, args)
    if cluster.replicas > 0:
        from blockserve.cluster.launch import serve_cluster

        return serve_cluster(engine_args, server_config, cluster)
    return serve(engine_args.create_configs(), server_config)


if __name__ == "__main__":
    sys.exit(main())
