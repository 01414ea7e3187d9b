"""How much of the LRU -> Belady gap can an eviction policy close on the Mooncake trace? A
set-level LRU simulator (it reproduces `blockserve replay`'s LRU column exactly) with three
kinds of eviction order:

  lru                      least recently freed first, a request's deeper blocks first
  counted-k                blocks used fewer than k times ever (counts survive eviction) go
                           first, LRU within each class: what frequency can see online
  oracle-within-H          blocks NOT used again within the next H requests go first (an
                           oracle: it reads the future), LRU within each class: the most a
                           perfect "reused soon?" predictor added to LRU can reach

    .venv/bin/python benchmarks/bench_policy_headroom.py [--capacities 1024 4096] [--out FILE]
"""

from __future__ import annotations

import argparse
import collections
import heapq
import itertools
from collections.abc import Callable, Sequence
from pathlib import Path

from report import emit

from blockserve.replay.simulate import next_uses, replay_belady
from blockserve.replay.trace import BlockLayout, TraceRequest, block_layouts, load_trace

TRACE = Path(__file__).parent / "data" / "mooncake_synthetic_trace.jsonl"
BLOCK_SIZE = 512
DEMOTED = -(10**12)  # added to the free order of a demoted block: it goes before all others

# key(request index, block depth, free order) -> eviction key (smallest evicted first)
KeyFunction = Callable[[int, int, int], int]


def simulate(
    trace: Sequence[TraceRequest],
    layouts: Sequence[BlockLayout],
    capacity: int,
    key: KeyFunction,
    on_request: Callable[[int, BlockLayout], None] = lambda index, layout: None,
) -> float:
    """Token hit rate: requests one at a time, blocks freed tail-first with `key`."""
    cached: dict[bytes, tuple[int, int] | None] = {}  # hash -> live (key, order), None: held
    heap: list[tuple[int, int, bytes]] = []
    order = itertools.count()
    hit_tokens = query_tokens = 0
    for index, (request, layout) in enumerate(zip(trace, layouts, strict=True)):
        if layout.num_blocks > capacity:
            continue
        hashes = layout.block_hashes
        hits = 0
        for block_hash in hashes[: layout.num_hittable_blocks]:
            if block_hash not in cached:
                break
            hits += 1
        hit_tokens += hits * BLOCK_SIZE
        query_tokens += request.input_length
        on_request(index, layout)
        for block_hash in hashes:
            if block_hash in cached:
                cached[block_hash] = None
        unhashed = layout.num_blocks - len(hashes)  # the partial last block
        for block_hash in hashes:
            if block_hash in cached:
                continue
            while len(cached) + 1 + unhashed > capacity:
                entry_key, entry_order, victim = heapq.heappop(heap)
                if cached.get(victim) == (entry_key, entry_order):
                    del cached[victim]
            cached[block_hash] = None
        for depth in range(len(hashes) - 1, -1, -1):
            free_order = next(order)
            entry = (key(index, depth, free_order), free_order)
            cached[hashes[depth]] = entry
            heapq.heappush(heap, (*entry, hashes[depth]))
    return hit_tokens / query_tokens


def counted(layouts: Sequence[BlockLayout], k: int) -> tuple[KeyFunction, Callable]:
    counts: collections.Counter[bytes] = collections.Counter()
    current: list[BlockLayout] = []

    def on_request(index: int, layout: BlockLayout) -> None:
        counts.update(layout.block_hashes[: layout.num_prompt_blocks])
        current[:] = [layout]

    def key(index: int, depth: int, free_order: int) -> int:
        rare = counts[current[0].block_hashes[depth]] < k
        return free_order + (DEMOTED if rare else 0)

    return key, on_request


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--capacities", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    trace = load_trace(TRACE)
    layouts = block_layouts(trace, BLOCK_SIZE)
    uses = next_uses(layouts)
    rows = []
    for capacity in args.capacities:
        row: dict = {"capacity_blocks": capacity}
        row["lru"] = simulate(trace, layouts, capacity, lambda i, d, o: o)
        row["belady"] = replay_belady(trace, layouts, capacity, BLOCK_SIZE, uses).token_hit_rate
        for k in (2, 3):
            key, on_request = counted(layouts, k)
            row[f"counted-{k}"] = simulate(trace, layouts, capacity, key, on_request)
        for horizon in (100, 300, 1000):

            def oracle(i: int, d: int, o: int, h: int = horizon) -> int:
                return o + (DEMOTED if uses[i][d] - i > h else 0)

            row[f"oracle-within-{horizon}"] = simulate(trace, layouts, capacity, oracle)
        gap = row["belady"] - row["lru"]
        row["half_gap_target"] = row["lru"] + gap / 2
        rows.append({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()})
    emit({"benchmark": "policy_headroom", "trace": TRACE.name, "rows": rows}, args.out)


if __name__ == "__main__":
    main()
