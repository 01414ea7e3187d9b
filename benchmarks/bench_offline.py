"""Offline throughput of the whole engine on the default model, with prefix caching on and off.

Workloads (greedy, ignore_eos):
  shared-prefix  64 requests: one shared 1,024-token prefix + a distinct 32-token suffix each,
                 32 output tokens.
  random         64 requests of 1,056 random tokens (no sharing), 32 output tokens.

Also times the scheduler (schedule + update_from_output) and the rest of the engine's
bookkeeping against the model runner, to show what the control plane costs per step, and
records each step's tokens and runner time (`runner_steps`).

    .venv/bin/python benchmarks/bench_offline.py [--workload shared-prefix random]
        [--caching on off] [--requests 64] [--dtype auto|float32] [--compile] [--profile N]
        [--max-tokens 32] [--paged-decode on|off] [--precached N] [--kv-written]
        [--lazy-memory] [--out FILE]

`--paged-decode off` keeps our paged-decode kernel out (blockserve/kernels; torch's
decode path serves), to profile the step without it. `--precached N` caches the first N
tokens of the first prompt before the run (a system prompt partly seen before): the first
request then computes the rest of the prefix on top of them in the same step as the others
find it cached. `--kv-written` writes every page of the KV cache (zeros, so nothing changes)
before the run: the cache is mapped in page by page as first written (runner/kv_cache.py), and
this shows what those first writes cost the run. `--lazy-memory` runs the engine as it was
before runner/first_touch.py: no KV pages mapped in ahead of their first write, glibc's malloc
limits left as they are; `kv_blocks_mapped_at_start` says how far the engine had mapped ahead
when the timed run began.
"""

from __future__ import annotations

import argparse
import platform
import random
import statistics
import time
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
from report import emit
from torch.profiler import ProfilerActivity, profile

from blockserve import LLM, SamplingParams
from blockserve.engine import core as engine_core

PREFIX_LEN = 1024
SUFFIX_LEN = 32
OUTPUT_LEN = 32


def make_prompts(workload: str, num_requests: int, vocab_size: int) -> list[list[int]]:
    rng = random.Random(0)
    high = min(vocab_size, 40000)
    if workload == "shared-prefix":
        prefix = [rng.randrange(100, high) for _ in range(PREFIX_LEN)]
        return [
            prefix + [rng.randrange(100, high) for _ in range(SUFFIX_LEN)]
            for _ in range(num_requests)
        ]
    return [
        [rng.randrange(100, high) for _ in range(PREFIX_LEN + SUFFIX_LEN)]
        for _ in range(num_requests)
    ]


class Timer:
    """Accumulates the wall time of calls to one bound method (installed on the instance);
    with `size` (the call's arguments → a number), also each call's (size, seconds)."""

    def __init__(self, owner: Any, name: str, size: Callable[..., int] | None = None) -> None:
        self.total = 0.0
        self.calls = 0
        self.sized: list[tuple[int, float]] = []
        wrapped: Callable[..., Any] = getattr(owner, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return wrapped(*args, **kwargs)
            finally:
                seconds = time.perf_counter() - start
                self.total += seconds
                self.calls += 1
                if size is not None:
                    self.sized.append((size(*args, **kwargs), seconds))

        setattr(owner, name, timed)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(int(q * len(ordered)), len(ordered) - 1)]


def run(
    workload: str,
    caching: bool,
    num_requests: int,
    dtype: str,
    top_ops: int = 0,
    compile_layers: bool = False,
    max_tokens: int = OUTPUT_LEN,
    paged_decode: bool = True,
    precached: int = 0,
    kv_written: bool = False,
) -> dict:
    llm = LLM(
        enable_prefix_caching=caching,
        max_num_seqs=num_requests,
        dtype=dtype,
        compile=compile_layers,
    )
    engine = llm.engine
    kernels = engine.core.runner.kernels
    kernels.loader.wait()  # its first build on a host runs while the engine starts
    kernels.set_enabled(True, paged=paged_decode)
    prompts = make_prompts(workload, num_requests, engine.core.info.vocab_size)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(prompts[0][:64], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
    if kv_written:
        for cache in engine.core.runner.kv_caches:
            cache.zero_()
    llm.reset_prefix_cache()
    kv_pages = engine.core.runner.kv_pages
    mapped_at_start = None if kv_pages is None else kv_pages.mapped_blocks
    if precached:
        llm.generate(prompts[0][:precached], SamplingParams(max_tokens=1), use_tqdm=False)
    before = llm.get_stats()
    steps = Timer(engine, "step")
    execute = Timer(engine.core.runner, "execute", size=lambda output: output.num_scheduled_tokens)
    schedule = Timer(engine.core.scheduler, "schedule")
    update = Timer(engine.core.scheduler, "update_from_output")
    profiler = profile(activities=[ProfilerActivity.CPU]) if top_ops else nullcontext()
    start = time.perf_counter()
    with profiler:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    stats = llm.get_stats()
    ttft = [o.metrics.first_token_time - o.metrics.arrival_time for o in outputs]  # type: ignore[operator]
    num_output = sum(len(o.outputs[0].token_ids) for o in outputs)
    num_prompt = sum(len(p) for p in prompts)
    queries = stats.prefix_cache_queries - before.prefix_cache_queries
    hits = stats.prefix_cache_hits - before.prefix_cache_hits
    scheduler_s = schedule.total + update.total
    result = {
        "workload": workload,
        "prefix_caching": caching,
        "requests": num_requests,
        "dtype": engine.core.info.dtype,
        "compiled": compile_layers,
        "max_tokens": max_tokens,
        "precached_tokens": precached,
        "kv_written_first": kv_written,
        "kv_blocks_mapped_at_start": mapped_at_start,
        "paged_decode": paged_decode
        and kernels.loader.ops(getattr(torch, engine.core.info.dtype)) is not None,
        "wall_s": round(wall, 2),
        "output_tokens_per_s": round(num_output / wall, 1),
        "total_tokens_per_s": round((num_output + num_prompt) / wall, 1),
        "ttft_mean_s": round(statistics.mean(ttft), 3),
        "ttft_p50_s": round(percentile(ttft, 0.5), 3),
        "ttft_p99_s": round(percentile(ttft, 0.99), 3),
        "hit_rate": round(hits / queries, 4) if queries else 0.0,
        "preemptions": stats.num_preemptions - before.num_preemptions,
        "steps": steps.calls,
        "scheduler_ms_per_step": round(scheduler_s / steps.calls * 1e3, 3),
        "runner_ms_per_step": round(execute.total / steps.calls * 1e3, 2),
        "scheduler_share_of_runner": round(scheduler_s / execute.total, 4),
        "engine_overhead_share_of_step": round((steps.total - execute.total) / steps.total, 4),
        "engine_overhead_ms_per_step": round((steps.total - execute.total) / steps.calls * 1e3, 3),
        "runner_steps": [
            {"tokens": tokens, "ms": round(seconds * 1e3, 1)} for tokens, seconds in execute.sized
        ],
    }
    if isinstance(profiler, profile):
        result["profile_top_ops"] = top_operators(profiler, top_ops)
    return result


def top_operators(profiler: profile, count: int) -> list[dict[str, Any]]:
    """The `count` torch operators with the most self CPU time in the run (its wall time then
    includes the profiler's own overhead)."""
    events = sorted(profiler.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in events)
    return [
        {
            "op": e.key,
            "self_s": round(e.self_cpu_time_total / 1e6, 3),
            "share": round(e.self_cpu_time_total / total, 4),
            "calls": e.count,
        }
        for e in events[:count]
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workload", nargs="+", default=["shared-prefix", "random"])
    parser.add_argument("--caching", nargs="+", default=["on", "off"])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--dtype", default="auto", help="auto (the host's native dtype) or float32")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument(
        "--compile", action="store_true", help="torch.compile the layers' math (--compile)"
    )
    parser.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="N",
        help="run under torch.profiler; keep top N ops",
    )
    parser.add_argument("--max-tokens", type=int, default=OUTPUT_LEN)
    parser.add_argument("--paged-decode", choices=("on", "off"), default="on")
    parser.add_argument("--precached", type=int, default=0, metavar="N")
    parser.add_argument(
        "--kv-written", action="store_true", help="write every KV cache page before the run"
    )
    parser.add_argument(
        "--lazy-memory",
        action="store_true",
        help="no KV pages mapped in ahead, glibc's malloc limits as they are",
    )
    args = parser.parse_args()
    if args.lazy_memory:  # the engine's runner then gets no page populator (0 blocks ahead)
        engine_core.blocks_per_step = lambda *_: 0
    runs = [
        run(
            workload,
            caching == "on",
            args.requests,
            args.dtype,
            args.profile,
            args.compile,
            args.max_tokens,
            args.paged_decode == "on",
            args.precached,
            args.kv_written,
        )
        for workload in args.workload
        for caching in args.caching
    ]
    results = {
        "benchmark": "offline",
        "model": "SmolLM2-135M-Instruct",
        "dtype": args.dtype,
        "machine": platform.machine(),
        "lazy_memory": args.lazy_memory,
        "runs": runs,
    }
    for workload in args.workload:
        by_caching = {r["prefix_caching"]: r["wall_s"] for r in runs if r["workload"] == workload}
        if True in by_caching and False in by_caching:
            results[f"{workload}_speedup_from_caching"] = round(
                by_caching[False] / by_caching[True], 2
            )
    emit(results, args.out)


if __name__ == "__main__":
    main()
