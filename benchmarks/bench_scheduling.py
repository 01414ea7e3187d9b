"""Cache-aware scheduling: `fcfs` against `lpm` on a deep queue of many prefix groups.

Sections:
  throughput  The engine on the default model (float32 unless --dtype), all requests submitted at
              once (a burst: the queue starts --groups x --per-group deep). Group g's prompts are
              one shared --prefix-len prefix + a distinct --suffix-len suffix, interleaved
              (request i is in group i % groups), --output-len tokens each, greedy, ignore_eos.
              The KV cache (--num-blocks) holds a few groups' prefixes, not all: under fcfs a
              group's prefix is evicted before its next request comes round. Reports throughput,
              the cached fraction of prompt tokens, TTFT p50/p99, the longest wait (arrival to
              first scheduled) and the largest arrival gap by which any request was overtaken
              (lpm's aging bound says at most --lpm-aging-s), and the online miss-ratio curve
              (the LRU hit rate at 1/16x to 16x the cache) each policy's traffic produced.
  cost        The scheduler alone (no model) with 10, 128, 1,000 and 10,000 waiting requests
              kept topped up: ms per step of add + schedule + update for fcfs, lpm (incremental
              matches) and fcfs plus the per-step full rescan and sort that SGLang's lpm does.

    .venv/bin/python benchmarks/bench_scheduling.py [--section throughput cost] [--out FILE]
"""

from __future__ import annotations

import argparse
import platform
import random
import statistics
import time
from collections import deque
from pathlib import Path

from report import emit

from blockserve import LLM, SamplingParams
from blockserve.config import SchedulerConfig
from blockserve.core.hashing import BlockHasher, RequestBlockHasher
from blockserve.core.kv_cache_manager import KVCacheManager
from blockserve.engine.outputs import RequestOutput
from blockserve.sched.output import ModelRunnerOutput
from blockserve.sched.queues import FcfsQueue
from blockserve.sched.request import Request
from blockserve.sched.scheduler import Scheduler

BLOCK_SIZE = 16


def group_prompts(groups: int, per_group: int, prefix_len: int, suffix_len: int) -> list[list[int]]:
    """Interleaved prefix groups from random.Random(0): prompt i is in group i % groups."""
    rng = random.Random(0)
    prefixes = [[rng.randrange(100, 40000) for _ in range(prefix_len)] for _ in range(groups)]
    return [
        prefixes[i % groups] + [rng.randrange(100, 40000) for _ in range(suffix_len)]
        for i in range(groups * per_group)
    ]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(int(q * len(ordered)), len(ordered) - 1)]


def max_overtaking_gap(outputs: list[RequestOutput]) -> float:
    """The largest `arrival(q) - arrival(r)` over pairs where q arrived after r but was
    scheduled before it: how far behind later arrivals any request was put."""
    by_scheduled = sorted(outputs, key=lambda o: o.metrics.first_scheduled_time or 0.0)
    latest_arrival_so_far = float("-inf")
    gap = 0.0
    for output in by_scheduled:  # everyone scheduled earlier was possibly a later arrival
        arrival = output.metrics.arrival_time
        gap = max(gap, latest_arrival_so_far - arrival)
        latest_arrival_so_far = max(latest_arrival_so_far, arrival)
    return gap


def throughput(policy: str, args: argparse.Namespace) -> dict:
    llm = LLM(
        scheduling_policy=policy,
        lpm_aging_s=args.lpm_aging_s,
        num_gpu_blocks_override=args.num_blocks,
        max_num_seqs=args.max_num_seqs,
        dtype=args.dtype,
    )
    prompts = group_prompts(args.groups, args.per_group, args.prefix_len, args.suffix_len)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate([7] * 40, SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
    llm.reset_prefix_cache()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    metrics = [o.metrics for o in outputs]
    ttft = [m.first_token_time - m.arrival_time for m in metrics]  # type: ignore[operator]
    waits = [m.first_scheduled_time - m.arrival_time for m in metrics]  # type: ignore[operator]
    num_prompt = sum(len(p) for p in prompts)
    num_output = sum(len(o.outputs[0].token_ids) for o in outputs)
    curve = llm.engine.miss_ratio_report()  # the warm-up's 40 tokens are in it: negligible
    return {
        "policy": policy,
        "requests": len(prompts),
        "wall_s": round(wall, 2),
        "requests_per_s": round(len(prompts) / wall, 2),
        "total_tokens_per_s": round((num_prompt + num_output) / wall, 1),
        "cached_fraction": round(sum(o.num_cached_tokens for o in outputs) / num_prompt, 4),
        "ttft_p50_s": round(percentile(ttft, 0.5), 3),
        "ttft_p99_s": round(percentile(ttft, 0.99), 3),
        "max_wait_s": round(max(waits), 3),
        "max_overtaking_gap_s": round(max_overtaking_gap(outputs), 4),
        "preemptions": llm.get_stats().num_preemptions,
        "miss_ratio_curve": {
            "actual_hit_rate": curve.actual_hit_rate,
            "sampling_rate": curve.sampling_rate,
            "points": [(p.capacity_blocks, p.estimated_hit_rate) for p in curve.points],
        },
    }


def rescan_and_sort(scheduler: Scheduler) -> None:
    """SGLang's lpm step: match every waiting request against the cache, then sort."""
    manager = scheduler.kv_cache_manager
    ordered = sorted(scheduler.waiting, key=lambda r: -manager.get_computed_blocks(r)[1])
    queue = FcfsQueue()
    for request in ordered:
        queue.add(request)
    scheduler.waiting = queue


def scheduler_cost(policy: str, num_waiting: int, steps: int) -> dict:
    """Median ms per step with `num_waiting` queued, over `steps` steps after 5 warm-up."""
    manager = KVCacheManager(8192, BLOCK_SIZE, enable_caching=True)
    queue_policy = "fcfs" if policy == "fcfs+rescan" else policy
    config = SchedulerConfig(64, 2048, max_model_len=4096, scheduling_policy=queue_policy)
    scheduler = Scheduler(config, manager)
    hasher = RequestBlockHasher(BlockHasher("sha256"), BLOCK_SIZE)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    prompts = group_prompts(64, -(-(num_waiting + 64 * (steps + 5)) // 64), 192, 64)
    pending = deque(Request(str(i), p, params, hasher) for i, p in enumerate(prompts))
    for _ in range(num_waiting):
        scheduler.add_request(pending.popleft())
    times = []
    for _ in range(steps + 5):
        start = time.perf_counter()
        while scheduler.num_waiting < num_waiting:
            scheduler.add_request(pending.popleft())
        if policy == "fcfs+rescan":
            rescan_and_sort(scheduler)
        output = scheduler.schedule()
        sampled = {s.request_id: 7 for s in output.scheduled if s.sample}
        scheduler.update_from_output(output, ModelRunnerOutput(sampled))
        times.append(time.perf_counter() - start)
    return {
        "policy": policy,
        "waiting": num_waiting,
        "ms_per_step_median": round(statistics.median(times[5:]) * 1e3, 3),
        "ms_per_step_max": round(max(times[5:]) * 1e3, 3),
    }


def aging(policy: str, aging_s: float) -> dict:
    """Starvation check, no model, simulated time (a step is 0.1 s): a hot group (448 shared
    tokens of a 512-token context) arrives one request a step for 300 steps, faster than the
    4 running slots serve it (5 steps each); one cold request (no match) arrives at step 10.
    Returns the cold request's wait and the largest arrival gap by which anyone was overtaken."""
    manager = KVCacheManager(1024, BLOCK_SIZE, enable_caching=True)
    config = SchedulerConfig(
        4, 2048, max_model_len=512, scheduling_policy=policy, lpm_aging_s=aging_s
    )
    scheduler = Scheduler(config, manager)
    hasher = RequestBlockHasher(BlockHasher("sha256"), BLOCK_SIZE)
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    rng = random.Random(0)
    prefix = [rng.randrange(100, 40000) for _ in range(448)]
    arrivals: dict[str, float] = {}
    admitted: dict[str, float] = {}
    for step in range(5000):
        now = step * 0.1
        if step < 300 or step == 10:
            for request_id in [f"hot{step}"] + (["cold"] if step == 10 else []):
                head = prefix if request_id != "cold" else [rng.randrange(100, 40000)] * 448
                request = Request(request_id, [*head, rng.randrange(100, 40000)], params, hasher)
                request.arrival_time = arrivals[request_id] = now
                scheduler.add_request(request)
        output = scheduler.schedule()
        for scheduled in output.scheduled:
            admitted.setdefault(str(scheduled.request_id), now)
        sampled = {s.request_id: 7 for s in output.scheduled if s.sample}
        scheduler.update_from_output(output, ModelRunnerOutput(sampled))
        if step >= 300 and not scheduler.has_unfinished_requests():
            break
    by_admission = sorted(admitted, key=lambda r: (admitted[r], arrivals[r]))
    latest, gap = float("-inf"), 0.0
    for request_id in by_admission:
        gap = max(gap, latest - arrivals[request_id])
        latest = max(latest, arrivals[request_id])
    return {
        "policy": policy,
        "lpm_aging_s": aging_s if policy == "lpm" else None,
        "cold_wait_s": round(admitted["cold"] - arrivals["cold"], 1),
        "max_overtaking_gap_s": round(gap, 2),
        "simulated_s_to_finish": round(step * 0.1, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--section", nargs="+", default=["throughput", "aging", "cost"])
    parser.add_argument("--groups", type=int, default=32)
    parser.add_argument("--per-group", type=int, default=16)
    parser.add_argument("--prefix-len", type=int, default=128)
    parser.add_argument("--suffix-len", type=int, default=16)
    parser.add_argument("--output-len", type=int, default=2)
    parser.add_argument("--num-blocks", type=int, default=160)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--lpm-aging-s", type=float, default=30.0)
    parser.add_argument("--dtype", default="float32", help="float32 (AVX2 hosts) or auto")
    parser.add_argument("--cost-steps", type=int, default=30)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    results: dict = {"benchmark": "scheduling", "machine": platform.machine()}
    if "throughput" in args.section:
        runs = [throughput(policy, args) for policy in ("fcfs", "lpm")]
        results["throughput"] = {
            "model": "SmolLM2-135M-Instruct",
            "dtype": args.dtype,
            "load": {
                k: getattr(args, k)
                for k in (
                    "groups",
                    "per_group",
                    "prefix_len",
                    "suffix_len",
                    "output_len",
                    "num_blocks",
                    "max_num_seqs",
                    "lpm_aging_s",
                )
            },
            "runs": runs,
            "lpm_speedup": round(runs[0]["wall_s"] / runs[1]["wall_s"], 2),
        }
    if "aging" in args.section:
        results["aging"] = [aging("fcfs", 0.0)] + [
            aging("lpm", aging_s) for aging_s in (2.0, 10.0, 30.0, 1e6)
        ]
    if "cost" in args.section:
        results["cost"] = [
            scheduler_cost(policy, num_waiting, args.cost_steps)
            for num_waiting in (10, 128, 1000, 10000)
            for policy in ("fcfs", "lpm", "fcfs+rescan")
        ]
    emit(results, args.out)


if __name__ == "__main__":
    main()
