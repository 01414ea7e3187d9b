"""Block-manager throughput: hash, look up, allocate, decode, free — one request at a time.

Workload (fixed by the Foundation issue, so figures compare across engines): token ids from
random.Random(0); 100 prefixes of 768 ids; 10,000 requests, each a random prefix + 256 suffix
ids + 16 decode ids. Pool of 20,000 blocks of 16. Per request, timed: build the request (hashing
its 64 prompt blocks), look up, allocate the uncached tokens, append the 16 decode tokens and
allocate for them in one call (which caches block 65), free.

    .venv/bin/python benchmarks/bench_block_manager.py [--repeats 3] [--out results/x.json]

Prints one JSON object: per algorithm and events on/off (and, for sha256, with the online
miss-ratio curve on), the median over repeats of requests/s and µs per request, plus µs per
block hashed, hit rate and evictions.
"""

from __future__ import annotations

import argparse
import platform
import random
import statistics
import time
from pathlib import Path

from report import emit

from blockserve.core.events import KVEventRecorder
from blockserve.core.hashing import HASH_FUNCTIONS, BlockHasher, RequestBlockHasher
from blockserve.core.kv_cache_manager import KVCacheManager
from blockserve.core.miss_ratio import MissRatioCurve
from blockserve.sched.request import Request

BLOCK_SIZE = 16
NUM_BLOCKS = 20_000
NUM_PREFIXES = 100
PREFIX_LEN = 768
SUFFIX_LEN = 256
DECODE_LEN = 16


def make_workload(num_requests: int) -> list[tuple[list[int], list[int]]]:
    """(prompt, decode tokens) per request, from random.Random(0) in the issue's order."""
    rng = random.Random(0)
    prefixes = [[rng.randrange(50000) for _ in range(PREFIX_LEN)] for _ in range(NUM_PREFIXES)]
    workload = []
    for _ in range(num_requests):
        prefix = prefixes[rng.randrange(NUM_PREFIXES)]
        suffix = [rng.randrange(50000) for _ in range(SUFFIX_LEN)]
        decode = [rng.randrange(50000) for _ in range(DECODE_LEN)]
        workload.append((prefix + suffix, decode))
    return workload


def run_once(
    workload: list[tuple[list[int], list[int]]], algo: str, events: bool, curve: bool = False
) -> dict:
    hasher = RequestBlockHasher(BlockHasher(algo, seed="bench"), BLOCK_SIZE)
    recorder = KVEventRecorder() if events else None
    manager = KVCacheManager(NUM_BLOCKS, BLOCK_SIZE, enable_caching=True, events=recorder)
    if curve:  # the engine's online miss-ratio curve, at its default sample budget
        points = [round(NUM_BLOCKS * 2.0**k) for k in range(-3, 4)]
        manager.track_miss_ratio(MissRatioCurve(BLOCK_SIZE, points))
    clock = time.perf_counter
    start = clock()
    for i, (prompt, decode) in enumerate(workload):
        request = Request(str(i), prompt, block_hasher=hasher)
        hit_blocks, num_hits = manager.get_computed_blocks(request)
        num_new = request.num_tokens - num_hits
        assert manager.allocate_slots(request, num_new, num_hits, hit_blocks) is not None
        request.num_computed_tokens = request.num_tokens
        request.append_output_token_ids(decode)
        assert manager.allocate_slots(request, DECODE_LEN) is not None
        request.num_computed_tokens = request.num_tokens
        manager.free(request)
        if recorder is not None:
            manager.take_events()  # the engine drains once per step
    elapsed = clock() - start
    stats = manager.prefix_cache_stats
    return {
        "requests_per_s": len(workload) / elapsed,
        "us_per_request": elapsed / len(workload) * 1e6,
        "hit_rate": stats.hits / stats.queries,
        "evictions": manager.block_pool.num_evictions,
    }


def hash_cost_us(workload: list[tuple[list[int], list[int]]], algo: str) -> float:
    """µs per block for hashing the prompts alone (64 blocks each)."""
    hasher = BlockHasher(algo, seed="bench")
    prompts = [prompt for prompt, _ in workload[:2000]]
    start = time.perf_counter()
    num_blocks = 0
    for prompt in prompts:
        num_blocks += len(hasher.hash_new_blocks(prompt, [], BLOCK_SIZE))
    return (time.perf_counter() - start) / num_blocks * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--algos", nargs="+", default=list(HASH_FUNCTIONS))
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = parser.parse_args()

    workload = make_workload(args.requests)
    results: dict = {
        "benchmark": "block_manager",
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
        "python": platform.python_version(),
        "requests": args.requests,
        "repeats": args.repeats,
        "runs": [],
    }
    for algo in args.algos:
        us_per_block = statistics.median(hash_cost_us(workload, algo) for _ in range(3))
        # The miss-ratio curve's cost is measured once, beside the default hash's plain run.
        variants = [(False, False), (True, False)] + ([(False, True)] if algo == "sha256" else [])
        for events, curve in variants:
            runs = [run_once(workload, algo, events, curve) for _ in range(args.repeats)]
            results["runs"].append(
                {
                    "algo": algo,
                    "events": events,
                    "miss_ratio_curve": curve,
                    "requests_per_s": round(statistics.median(r["requests_per_s"] for r in runs)),
                    "us_per_request": round(
                        statistics.median(r["us_per_request"] for r in runs), 1
                    ),
                    "us_per_block_hashed": round(us_per_block, 3),
                    "hit_rate": round(runs[0]["hit_rate"], 4),
                    "evictions": runs[0]["evictions"],
                }
            )
    emit(results, args.out)


if __name__ == "__main__":
    main()
