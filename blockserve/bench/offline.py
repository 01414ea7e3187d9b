"""`blockserve bench offline`: the whole engine's offline throughput on the default model, per
workload (a shared 1,024-token prefix, or random prompts) with prefix caching on and off, and
what the control plane costs per step beside the model runner."""

from __future__ import annotations

import argparse
import platform
import random
import statistics
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from blockserve.bench.harness import table

PREFIX_LEN = 1024
SUFFIX_LEN = 32
OUTPUT_LEN = 32
WORKLOADS = ("shared-prefix", "random")


@dataclass(frozen=True, slots=True)
class OfflineRun:
    """One timed `generate` over a workload, and how the engine is set up for it."""

    workload: str
    caching: bool
    requests: int = 64
    dtype: str = "auto"
    top_ops: int = 0  # run under torch.profiler and keep the top N operators
    compiled: bool = False
    max_tokens: int = OUTPUT_LEN
    paged_decode: bool = True  # our paged-decode kernel (False: torch's decode path)
    precached: int = 0  # tokens of the first prompt cached before the run
    kv_written: bool = False  # every KV page written before the run


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


def run(spec: OfflineRun) -> dict[str, Any]:
    """Build an engine for `spec`, warm it, time one `generate` over the workload."""
    from torch.profiler import ProfilerActivity, profile

    from blockserve import LLM, SamplingParams

    llm = LLM(
        enable_prefix_caching=spec.caching,
        max_num_seqs=spec.requests,
        dtype=spec.dtype,
        compile=spec.compiled,
    )
    engine = llm.engine
    kernels = engine.core.runner.kernels
    kernels.loader.wait()  # its first build on a host runs while the engine starts
    kernels.set_enabled(True, paged=spec.paged_decode)
    prompts = make_prompts(spec.workload, spec.requests, engine.core.info.vocab_size)
    llm.generate(prompts[0][:64], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
    if spec.kv_written:
        for cache in engine.core.runner.kv_caches:
            cache.zero_()
    llm.reset_prefix_cache()
    kv_pages = engine.core.runner.kv_pages
    mapped_at_start = None if kv_pages is None else kv_pages.mapped_blocks
    if spec.precached:
        llm.generate(prompts[0][: spec.precached], SamplingParams(max_tokens=1), use_tqdm=False)
    before = llm.get_stats()
    timers = {
        "step": Timer(engine, "step"),
        "execute": Timer(engine.core.runner, "execute", size=lambda o: o.num_scheduled_tokens),
        "schedule": Timer(engine.core.scheduler, "schedule"),
        "update": Timer(engine.core.scheduler, "update_from_output"),
    }
    profiler = profile(activities=[ProfilerActivity.CPU]) if spec.top_ops else nullcontext()
    params = SamplingParams(temperature=0.0, max_tokens=spec.max_tokens, ignore_eos=True)
    start = time.perf_counter()
    with profiler:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    result = {
        **describe(spec, engine.core.info.dtype, mapped_at_start),
        "paged_decode": spec.paged_decode and kernels.loader.ops(kernels_dtype(engine)) is not None,
        **measures(outputs, prompts, wall, llm.get_stats(), before),
        **step_costs(timers),
    }
    if isinstance(profiler, profile):
        result["profile_top_ops"] = top_operators(profiler, spec.top_ops)
    return result


def kernels_dtype(engine: Any) -> Any:
    import torch

    return getattr(torch, engine.core.info.dtype)


def describe(spec: OfflineRun, dtype: str, mapped_at_start: int | None) -> dict[str, Any]:
    return {
        "workload": spec.workload,
        "prefix_caching": spec.caching,
        "requests": spec.requests,
        "dtype": dtype,
        "compiled": spec.compiled,
        "max_tokens": spec.max_tokens,
        "precached_tokens": spec.precached,
        "kv_written_first": spec.kv_written,
        "kv_blocks_mapped_at_start": mapped_at_start,
    }


def measures(
    outputs: list[Any], prompts: list[list[int]], wall: float, stats: Any, before: Any
) -> dict[str, Any]:
    """Throughput, first-token times and the cache's hits of the timed run."""
    from blockserve.bench.harness import percentile

    ttft = [o.metrics.first_token_time - o.metrics.arrival_time for o in outputs]
    num_output = sum(len(o.outputs[0].token_ids) for o in outputs)
    num_prompt = sum(len(p) for p in prompts)
    queries = stats.prefix_cache_queries - before.prefix_cache_queries
    hits = stats.prefix_cache_hits - before.prefix_cache_hits
    return {
        "wall_s": round(wall, 2),
        "output_tokens_per_s": round(num_output / wall, 1),
        "total_tokens_per_s": round((num_output + num_prompt) / wall, 1),
        "ttft_mean_s": round(statistics.mean(ttft), 3),
        "ttft_p50_s": round(percentile(ttft, 0.5), 3),
        "ttft_p99_s": round(percentile(ttft, 0.99), 3),
        "hit_rate": round(hits / queries, 4) if queries else 0.0,
        "preemptions": stats.num_preemptions - before.num_preemptions,
    }


def step_costs(timers: dict[str, Timer]) -> dict[str, Any]:
    """Per step: the scheduler's and the rest of the engine's time beside the runner's."""
    steps, execute = timers["step"], timers["execute"]
    scheduler_s = timers["schedule"].total + timers["update"].total
    overhead = steps.total - execute.total
    return {
        "steps": steps.calls,
        "scheduler_ms_per_step": round(scheduler_s / steps.calls * 1e3, 3),
        "runner_ms_per_step": round(execute.total / steps.calls * 1e3, 2),
        "scheduler_share_of_runner": round(scheduler_s / execute.total, 4),
        "engine_overhead_share_of_step": round(overhead / steps.total, 4),
        "engine_overhead_ms_per_step": round(overhead / steps.calls * 1e3, 3),
        "runner_steps": [
            {"tokens": tokens, "ms": round(seconds * 1e3, 1)} for tokens, seconds in execute.sized
        ],
    }


def top_operators(profiler: Any, count: int) -> list[dict[str, Any]]:
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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--workload",
        nargs="+",
        choices=WORKLOADS,
        default=list(WORKLOADS),
        help="shared-prefix: one 1,024-token prefix and a distinct 32-token suffix per request; "
        "random: 1,056 random tokens each, nothing shared (default: both)",
    )
    parser.add_argument(
        "--caching",
        nargs="+",
        choices=("on", "off"),
        default=["on", "off"],
        help="prefix caching on, off, or both (default), one engine each",
    )
    parser.add_argument("--requests", type=int, default=64, help="requests per run (default 64)")
    parser.add_argument("--dtype", default="auto", help="auto (the host's native dtype) or float32")
    parser.add_argument("--out", type=Path, default=None, help="write the full JSON here")
    parser.add_argument("--json", action="store_true", help="print the full JSON, not a table")
    parser.add_argument("--compile", action="store_true", help="the compiled forward")
    parser.add_argument(
        "--profile", type=int, default=0, metavar="N", help="torch.profiler's top N operators"
    )
    parser.add_argument(
        "--max-tokens",
        type=int,
        default=OUTPUT_LEN,
        help=f"tokens each request generates (default {OUTPUT_LEN}, ignoring EOS)",
    )
    parser.add_argument(
        "--paged-decode",
        choices=("on", "off"),
        default="on",
        help="off: our paged-decode kernel left out, torch's decode path serving",
    )
    parser.add_argument(
        "--precached",
        type=int,
        default=0,
        metavar="N",
        help="cache the first N tokens of the first prompt before the timed run",
    )
    parser.add_argument(
        "--kv-written", action="store_true", help="write every KV cache page before the run"
    )


OFFLINE_COLUMNS = [
    "workload",
    "caching",
    "requests",
    "wall s",
    "output tok/s",
    "TTFT p50 s",
    "hit rate",
    "preemptions",
]


def summary(results: dict[str, Any]) -> str:
    """The runs as a table, then each workload's speed-up from caching."""
    rows = [
        [
            run["workload"],
            "on" if run["prefix_caching"] else "off",
            run["requests"],
            run["wall_s"],
            run["output_tokens_per_s"],
            run["ttft_p50_s"],
            run["hit_rate"],
            run["preemptions"],
        ]
        for run in results["runs"]
    ]
    lines = [table(OFFLINE_COLUMNS, rows)]
    for key, value in results.items():
        if key.endswith("_speedup_from_caching"):
            workload = key.removesuffix("_speedup_from_caching")
            lines.append(f"{workload}: {value}x faster with prefix caching")
    return "\n".join(lines)


def run_command(args: argparse.Namespace, notes: dict[str, Any] | None = None) -> int:
    """Every run `args` asks for: one JSON document (with `notes` added) to --out and, with
    --json, to stdout; else a table."""
    from blockserve.bench.harness import emit

    runs = [
        run(
            OfflineRun(
                workload=workload,
                caching=caching == "on",
                requests=args.requests,
                dtype=args.dtype,
                top_ops=args.profile,
                compiled=args.compile,
                max_tokens=args.max_tokens,
                paged_decode=args.paged_decode == "on",
                precached=args.precached,
                kv_written=args.kv_written,
            )
        )
        for workload in args.workload
        for caching in args.caching
    ]
    results: dict[str, Any] = {
        "benchmark": "offline",
        "model": "SmolLM2-135M-Instruct",
        "dtype": args.dtype,
        "machine": platform.machine(),
        **(notes or {}),
        "runs": runs,
    }
    for workload in args.workload:
        by_caching = {r["prefix_caching"]: r["wall_s"] for r in runs if r["workload"] == workload}
        if True in by_caching and False in by_caching:
            speedup = by_caching[False] / by_caching[True]
            results[f"{workload}_speedup_from_caching"] = round(speedup, 2)
    emit(results, args.out, to_stdout=args.json)
    if not args.json:
        print(summary(results))
        print(f"full JSON: {args.out}" if args.out else "full JSON: --out PATH or --json")
    return 0
