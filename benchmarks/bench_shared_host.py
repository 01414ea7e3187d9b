"""Decode speed on a shared CPU host: one streamed request's decode tokens/s from a real
`blockserve serve` (the embedded model), alone and beside a competing CPU-bound process, for
the default threads (adapted to the host), fixed counts, and OpenMP's passive wait policy.
Competitors: `hog`, a process multiplying matrices with torch on every core; `server`, a
second blockserve server (default flags) kept busy by four streaming clients. Medians of
`--runs` requests of 128 tokens.

    .venv/bin/python benchmarks/bench_shared_host.py
        [--configs auto threads-2 threads-1 passive-2] [--competitors none hog server]
        [--runs 5] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import emit

from blockserve.bench.server_process import ServerProcess

TOKENS = 128
# Flags, and environment, of the measured server: the default (threads adapted to the host),
# fixed counts, and OpenMP's passive wait policy (no spinning) with two fixed threads.
CONFIGS = {
    "auto": ([], {}),
    "threads-2": (["--cpu-threads", "2"], {}),
    "threads-1": (["--cpu-threads", "1"], {}),
    "passive-2": (["--cpu-threads", "2"], {"OMP_WAIT_POLICY": "PASSIVE"}),
}
HOG = """
import time, torch
a = torch.randn(1024, 1024)
while True:
    a @ a
"""


def decode_rate(url: str, prompt: str) -> float:
    """Tokens per second after the first, of one streamed completion of TOKENS tokens."""
    body = {"prompt": prompt, "max_tokens": TOKENS, "ignore_eos": True, "stream": True}
    stamps = []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                stamps.append(time.perf_counter())
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


def keep_busy(url: str, stop: threading.Event) -> None:
    body = {"prompt": "Write a long story.", "max_tokens": 256, "ignore_eos": True}
    while not stop.is_set():
        httpx.post(f"{url}/v1/completions", json=body, timeout=600)


@contextmanager
def competitor(kind: str, logs: Path) -> Iterator[None]:
    if kind == "none":
        yield
        return
    if kind == "hog":
        hog = subprocess.Popen([sys.executable, "-c", HOG])
        try:
            time.sleep(2)
            yield
        finally:
            hog.kill()
            hog.wait()
        return
    other = ServerProcess([], logs / "competitor.log")
    stop = threading.Event()
    clients = [threading.Thread(target=keep_busy, args=(other.url, stop)) for _ in range(4)]
    for client in clients:
        client.start()
    try:
        time.sleep(2)
        yield
    finally:
        stop.set()
        for client in clients:
            client.join()
        other.stop()


def measure(config: str, kind: str, runs: int, logs: Path) -> dict[str, object]:
    flags, env = CONFIGS[config]
    server = ServerProcess(flags, logs / f"{config}-{kind}.log", env=env)
    try:
        for _ in range(2):  # the first requests load kernels and map the cache's pages in
            decode_rate(server.url, "warm up")
        with competitor(kind, logs):
            decode_rate(server.url, "warm up beside it")  # the thread count settles
            rates = [decode_rate(server.url, f"Tell me a story, number {i}.") for i in range(runs)]
        lines = server.log_path.read_text(errors="replace").splitlines()
        changes = [line.split("compute threads ")[1] for line in lines if "compute threads" in line]
    finally:
        server.stop()
    result = {
        "tokens_per_s": round(statistics.median(rates), 1),
        "runs": [round(r, 1) for r in rates],
    }
    return {**result, "thread_changes": changes}


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument(
        "--configs", nargs="+", choices=list(CONFIGS), default=["auto", "threads-2", "threads-1"]
    )
    parser.add_argument(
        "--competitors",
        nargs="+",
        choices=("none", "hog", "server"),
        default=["none", "hog", "server"],
    )
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    results: dict[str, dict[str, object]] = {}
    with tempfile.TemporaryDirectory() as logs:
        for config in args.configs:
            for kind in args.competitors:
                results[f"{config}/{kind}"] = measure(config, kind, args.runs, Path(logs))
                print(config, kind, json.dumps(results[f"{config}/{kind}"]), flush=True)
    slowdowns = {
        key: round(results[f"{key.split('/')[0]}/none"]["tokens_per_s"] / value["tokens_per_s"], 2)  # type: ignore[operator]
        for key, value in results.items()
        if not key.endswith("/none") and f"{key.split('/')[0]}/none" in results
    }
    emit(
        {
            "benchmark": "shared_host",
            "tokens": TOKENS,
            "cores": len(os.sched_getaffinity(0)),
            "results": results,
            "slowdown": slowdowns,
        },
        args.out,
    )


if __name__ == "__main__":
    main()
