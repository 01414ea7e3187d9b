"""Start-up: seconds from launching `blockserve serve` (the default model) to /health answering.

Cold: a fresh, empty BLOCKSERVE_CACHE_DIR, so the embedded GGUF is dequantized into a Hugging
Face directory first (and, with `--compile`, the forward compiled into it). Warm: the same
cache dir again. Each start is a new process, stopped with SIGINT; the figure is the median of
`--repeats` starts.

    .venv/bin/python benchmarks/bench_startup.py [--compile] [--repeats 3] [--out FILE]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

from report import emit

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from blockserve.bench.server_process import ServerProcess


def time_start(cache_dir: str, log: Path, flags: list[str]) -> float:
    started = time.perf_counter()
    server = ServerProcess(flags, log, env={"BLOCKSERVE_CACHE_DIR": cache_dir}, ready_timeout=600)
    ready = time.perf_counter() - started
    server.stop()
    return ready


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--compile", action="store_true", help="start with --compile")
    args = parser.parse_args()
    flags = ["--compile"] if args.compile else []
    cold, warm = [], []
    with tempfile.TemporaryDirectory() as scratch:
        for attempt in range(args.repeats):
            cache_dir = Path(scratch) / f"cache-{attempt}"
            log = Path(scratch) / "server.log"
            cold.append(time_start(str(cache_dir), log, flags))
            warm.append(time_start(str(cache_dir), log, flags))
    emit(
        {
            "benchmark": "startup",
            "flags": flags,
            "cold_s": [round(s, 2) for s in cold],
            "warm_s": [round(s, 2) for s in warm],
            "cold_median_s": round(statistics.median(cold), 2),
            "warm_median_s": round(statistics.median(warm), 2),
        },
        args.out,
    )


if __name__ == "__main__":
    main()
