"""Eager against compiled layer math (`--compile`), paired, in one process on one model.

One engine is built with `compile=True`; each round then runs the same workload twice, once
with the runner's eager forward swapped back in and once with the compiled one, in
alternating order, so that host noise falls on both alike. Reports each workload's wall times,
their medians per mode, the ratio, and how many requests produced the same tokens both ways.

Workloads (greedy, ignore_eos, prefix caching on):
  shared-prefix  bench_offline.py's: 64 × (1,024 shared + 32 own tokens) → 32 tokens.
  decode-8       8 requests of 32 tokens → 128 tokens: small decode batches.

    .venv/bin/python benchmarks/bench_compile.py [--dtype auto] [--rounds 3] [--out FILE]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from bench_offline import make_prompts
from report import emit

from blockserve import LLM, SamplingParams


def workloads(vocab_size: int) -> dict[str, tuple[list[list[int]], SamplingParams]]:
    rng = random.Random(1)
    short = [[rng.randrange(100, 40000) for _ in range(32)] for _ in range(8)]
    return {
        "shared-prefix": (
            make_prompts("shared-prefix", 64, vocab_size),
            SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True),
        ),
        "decode-8": (short, SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True)),
    }


def timed_generate(
    llm: LLM, prompts: list[list[int]], params: SamplingParams
) -> tuple[float, list]:
    llm.reset_prefix_cache()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start, [o.outputs[0].token_ids for o in outputs]


def paired(
    llm: LLM,
    prompts: list[list[int]],
    params: SamplingParams,
    modes: dict[str, Callable[[], None]],
    rounds: int,
) -> tuple[dict[str, list[float]], int]:
    """Each mode's wall times, `rounds` each, and how many requests gave the same tokens in
    every mode. A round runs the workload once per mode (`modes[name]()` switches to it), the
    order reversed every other round so that the host's noise falls on all alike."""
    walls: dict[str, list[float]] = {mode: [] for mode in modes}
    tokens: dict[str, list] = {}
    for round_index in range(rounds):
        order = list(modes) if round_index % 2 == 0 else list(reversed(modes))
        for mode in order:
            modes[mode]()
            wall, tokens[mode] = timed_generate(llm, prompts, params)
            walls[mode].append(round(wall, 3))
    same = sum(len(set(map(tuple, answers))) == 1 for answers in zip(*tokens.values(), strict=True))
    return walls, same


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    llm = LLM(max_num_seqs=64, dtype=args.dtype, compile=True)
    runner = llm.engine.core.runner
    assert runner.compile_report is not None
    forwards: dict[str, Any] = {"eager": runner.model, "compiled": runner.forward}
    modes = {mode: partial(setattr, runner, "forward", fn) for mode, fn in forwards.items()}
    results: dict[str, Any] = {}
    for name, (prompts, params) in workloads(llm.engine.core.info.vocab_size).items():
        walls, same = paired(llm, prompts, params, modes, args.rounds)
        eager, compiled = (statistics.median(walls[m]) for m in ("eager", "compiled"))
        results[name] = {
            "wall_s": walls,
            "eager_median_s": eager,
            "compiled_median_s": compiled,
            "speedup": round(eager / compiled, 3),
            "same_tokens": same,
            "requests": len(prompts),
        }
    report = runner.compile_report
    emit(
        {
            "benchmark": "compile",
            "dtype": llm.engine.core.info.dtype,
            "compile_s": round(report.seconds, 2),
            "graphs": report.graphs,
            "cache_hits": report.cache_hits,
            "cache_misses": report.cache_misses,
            "workloads": results,
        },
        args.out,
    )


if __name__ == "__main__":
    main()
