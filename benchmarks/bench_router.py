"""The KV-aware router's own cost per request: hashing the prompt's blocks and scoring every
replica's index, at N replicas whose indices hold random leading parts of the prompt; and the
memory of one replica's index per block held.

    .venv/bin/python benchmarks/bench_router.py --replicas 64 --prompt-tokens 15300
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import sys
import time
import tracemalloc
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.report import emit
from blockserve.cluster.index import PrefixIndex
from blockserve.cluster.policies import KVAwarePolicy
from blockserve.cluster.routing import ReplicaLoad, route_request
from blockserve.core.events import BlockStored, KVEventBatch
from blockserve.core.hashing import BlockHasher
from blockserve.engine.request import RequestSpec


def median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return round(statistics.median(times) * 1e3, 3)


def mirror_bytes_per_block(num_blocks: int = 100_000) -> float:
    """Memory of one replica's index holding `num_blocks` uint64 hashes, per block."""
    rng = random.Random(1)
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    index = PrefixIndex(max_credits=1)
    hashes = [rng.getrandbits(64) for _ in range(num_blocks)]
    index.apply(
        [KVEventBatch(ts=0.0, events=[BlockStored(hashes, None, [], 16, None, "GPU", None)])]
    )
    del hashes
    gc.collect()
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    assert index.num_blocks == num_blocks
    return round(used / num_blocks, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--replicas", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=15300, help="Mooncake's mean")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--hash-algo", default="sha256")
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/router/router.json"))
    args = parser.parse_args()
    rng = random.Random(0)
    tokens = tuple(rng.randrange(50000) for _ in range(args.prompt_tokens))
    hasher = BlockHasher(args.hash_algo)
    route = route_request(RequestSpec("r", tokens), hasher, args.block_size)
    policy = KVAwarePolicy(max_blocks_per_replica=1 << 20)
    loads = []
    for i in range(args.replicas):
        held = route.block_hashes[: rng.randrange(len(route.block_hashes) + 1)]
        event = BlockStored(list(held), None, [], args.block_size, None, "GPU", None)
        policy.index(f"r{i}").apply([KVEventBatch(ts=0.0, events=[event])])
        loads.append(ReplicaLoad(f"r{i}", rng.randrange(8)))
    hash_ms = median_ms(
        lambda: route_request(RequestSpec("r", tokens), hasher, args.block_size), 20
    )
    rank_ms = median_ms(lambda: policy.rank(route, loads, 0.0), args.repeats)
    emit(
        {
            "benchmark": "router",
            "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "blocks": len(route.block_hashes),
            "hash_ms": hash_ms,
            "rank_ms": rank_ms,
            "mirror_bytes_per_block": mirror_bytes_per_block(),
        },
        args.out,
    )


if __name__ == "__main__":
    main()
