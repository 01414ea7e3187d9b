"""One model step of the offline shared-prefix workload, timed and profiled on its own.

Runs the workload of bench_offline.py (64 × (1,024 shared + 32 own tokens), greedy, prefix
caching on, in `--dtype`: by default bf16 where the host computes it natively) far enough to
capture two of its steps, then runs each again and again on the same inputs: the model's
forward, the LM head on the sampled rows, and the attention plan, as the runner does (the KV
it writes is the same each time). The two steps:

  prefill  the first step: one request's 1,056 tokens and 31 others' 32 own tokens on the
           shared prefix it computes (2,048 tokens)
  decode   a step of 64 decodes, each over 1,024 shared and 33 own tokens

Each step runs with our fused layer operators (blockserve/kernels) and without,
alternating, `--repeats` times each way per round; medians. Where our products of few rows
serve (bf16 on a CPU with AMX-BF16, float32 on our vector kernel) a third way runs too: fused,
but with oneDNN's products where ours would serve (`onednn_products`; `tiles_speedup`, or
`vectors_speedup` in float32, is it over `fused`). And fused, but with the shared prefix's
common blocks packed for our prefix kernel on every call instead of kept from the step before
(`packing_each_step`; `kept_packing_speedup`). `--profile N` then runs each step under
torch.profiler and keeps its top N operators by self time (per step, milliseconds).
`--breakdown` times each fused step's parts by wall clock instead (the profiler stretches short
parallel operators several-fold): the linear layers' products (LM head included), attention
(the backend's forward: KV writes, our kernels, the glue between them), the fused layer
operators, and the rest (Python, views, sampling rows, the plan). The decode step's greedy
sampling is timed on its logits two ways (`greedy_sampling_ms`): widened to float32, then
torch.max, as the sampler did before it took the LM head's bf16 logits as they are, and the
sampler's argmax now (our kernel where it is loaded).

    .venv/bin/python benchmarks/bench_step.py [--repeats 20] [--rounds 3] [--profile 15]
        [--breakdown] [--dtype auto|float32] [--out FILE]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from bench_offline import make_prompts
from report import emit
from torch.profiler import ProfilerActivity, profile

from blockserve import LLM, SamplingParams
from blockserve.attention.common_blocks import MAX_BYTES
from blockserve.model import llama
from blockserve.model.packed import PackedLinear
from blockserve.model.sampler import argmax
from blockserve.runner.inputs import ModelInputs
from blockserve.runner.model_runner import ModelRunner
from blockserve.sched.output import SchedulerOutput

NUM_REQUESTS = 64


def capture_steps(llm: LLM) -> dict[str, ModelInputs]:
    """The inputs of the workload's first prefill step and of its first full decode step, as
    the runner prepared them (fresh tensors each step)."""
    runner: ModelRunner = llm.engine.core.runner
    captured: dict[str, ModelInputs] = {}
    prepare = runner.prepare_inputs

    def capturing(output: SchedulerOutput) -> ModelInputs:
        inputs = prepare(output)
        decodes = output.num_scheduled_tokens == len(output.scheduled) == NUM_REQUESTS
        kind = "decode" if decodes else "prefill" if not captured else None
        if kind is not None and kind not in captured:
            captured[kind] = inputs
        return inputs

    runner.prepare_inputs = capturing  # type: ignore[method-assign]
    prompts = make_prompts("shared-prefix", NUM_REQUESTS, llm.engine.core.info.vocab_size)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    try:
        llm.generate(prompts, params, use_tqdm=False)
    finally:
        runner.prepare_inputs = prepare  # type: ignore[method-assign]
    return captured


@torch.inference_mode()
def run_step(runner: ModelRunner, inputs: ModelInputs) -> torch.Tensor:
    """The step's forward and LM head; its logits (as the LM head gives them)."""
    plan = runner.backend.prepare(inputs.metadata)
    hidden = runner.forward(inputs.input_ids, inputs.positions, runner.kv_caches, plan)
    return runner.model.compute_logits(hidden[inputs.sample_indices])


def greedy_sampling(logits: torch.Tensor, repeats: int) -> dict[str, float]:
    """Median ms of a greedy batch's argmax on these logits: widened to float32 first, then
    torch.max (the sampler before it took bf16 logits), against the sampler's argmax as it is
    (our kernel on the logits as they are, where it is loaded)."""
    ways = {
        "widened_max": lambda: logits.float().max(dim=-1).indices,
        "argmax": lambda: argmax(logits),
    }
    walls: dict[str, list[float]] = {way: [] for way in ways}
    for _ in range(repeats):
        for way, call in ways.items():
            start = time.perf_counter()
            call()
            walls[way].append(time.perf_counter() - start)
    return {way: round(statistics.median(t) * 1e3, 3) for way, t in walls.items()}


def time_step(runner: ModelRunner, inputs: ModelInputs, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run_step(runner, inputs)
        times.append(time.perf_counter() - start)
    return times


def top_operators(runner: ModelRunner, inputs: ModelInputs, repeats: int, count: int) -> list:
    with profile(activities=[ProfilerActivity.CPU]) as profiler:
        for _ in range(repeats):
            run_step(runner, inputs)
    events = sorted(profiler.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in events)
    return [
        {
            "op": e.key,
            "ms_per_step": round(e.self_cpu_time_total / repeats / 1e3, 2),
            "share": round(e.self_cpu_time_total / total, 3),
            "calls_per_step": round(e.count / repeats, 1),
        }
        for e in events[:count]
    ] + [{"op": "total", "ms_per_step": round(total / repeats / 1e3, 2)}]


def breakdown(runner: ModelRunner, inputs: ModelInputs, repeats: int) -> dict[str, float]:
    """Milliseconds a step spends in each part, by wall clock around each call (the fused
    layer operators on)."""
    spent: dict[str, float] = dict.fromkeys(("linear", "attention", "layer_ops"), 0.0)

    def timed(part: str, fn: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[part] += time.perf_counter() - start

        return call

    class TimedOps:  # a library of fused operators, each call timed
        def __init__(self, library: Any) -> None:
            self.library = library

        def __getattr__(self, name: str) -> Any:
            return timed("layer_ops", getattr(self.library, name))

    def layer_ops(hidden: torch.Tensor, head_dim: int) -> Any:
        library = find_ops(hidden, head_dim)
        return None if library is None else TimedOps(library)

    find_ops = runner.kernels.layer_ops
    patches = [
        (PackedLinear, "forward", timed("linear", PackedLinear.forward)),
        (llama, "attend", timed("attention", llama.attend)),
        (runner.kernels, "layer_ops", layer_ops),
    ]
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
    for owner, name, replacement in patches:
        setattr(owner, name, replacement)
    try:
        start = time.perf_counter()
        for _ in range(repeats):
            run_step(runner, inputs)
        total = time.perf_counter() - start
    finally:
        for owner, name, original in saved:
            setattr(owner, name, original)
    parts = {part: seconds / repeats * 1e3 for part, seconds in spent.items()}
    parts["rest"] = total / repeats * 1e3 - sum(parts.values())
    return {part: round(ms, 2) for part, ms in parts.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--profile", type=int, default=0, metavar="N")
    parser.add_argument("--breakdown", action="store_true")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    llm = LLM(enable_prefix_caching=True, max_num_seqs=NUM_REQUESTS, dtype=args.dtype)
    runner: ModelRunner = llm.engine.core.runner
    kernels = runner.kernels
    if not kernels.loader.wait():
        raise SystemExit("our CPU kernels are not available here (see the log)")
    steps = capture_steps(llm)
    results: dict[str, Any] = {}
    for kind, inputs in steps.items():
        repeats = args.repeats if kind == "decode" else max(2, args.repeats // 10)
        run_step(runner, inputs)  # warm
        modes = ["fused", "unfused", "packing_each_step"]
        if kernels.tile_linear(
            inputs.input_ids.new_empty(0, dtype=torch.bfloat16)
        ) or kernels.vector_linear(
            inputs.input_ids.new_empty(0, dtype=torch.float32),
            kernels.loader.isa(torch.float32),
        ):
            modes.append("onednn_products")
        walls: dict[str, list[float]] = {mode: [] for mode in modes}
        kept = runner.backend.common_blocks
        for round_index in range(args.rounds):
            for mode in modes if round_index % 2 == 0 else modes[::-1]:
                kernels.set_enabled(
                    True, layer=mode != "unfused", products=mode != "onednn_products"
                )
                kept.max_bytes = 0 if mode == "packing_each_step" else MAX_BYTES
                kept.forget()  # the next step starts from nothing kept
                run_step(runner, inputs)  # the step that packs (kept from here, but there)
                walls[mode].extend(time_step(runner, inputs, repeats))
        kernels.set_enabled(True)
        kept.max_bytes = MAX_BYTES
        medians = {mode: round(statistics.median(t) * 1e3, 2) for mode, t in walls.items()}
        results[kind] = {
            "tokens": int(inputs.input_ids.numel()),
            "median_ms": medians,
            "speedup": round(medians["unfused"] / medians["fused"], 3),
        }
        results[kind]["kept_packing_speedup"] = round(
            medians["packing_each_step"] / medians["fused"], 3
        )
        if "onednn_products" in medians:
            name = "vectors_speedup" if llm.engine.core.info.dtype == "float32" else "tiles_speedup"
            results[kind][name] = round(medians["onednn_products"] / medians["fused"], 3)
        if kind == "decode":
            logits = run_step(runner, inputs)
            results[kind]["greedy_sampling_ms"] = greedy_sampling(logits, 5 * repeats)
        if args.breakdown:
            results[kind]["breakdown_ms"] = breakdown(runner, inputs, repeats)
        if args.profile:
            for mode in ("unfused", "fused"):
                kernels.set_enabled(True, layer=mode == "fused")
                results[kind][f"profile_{mode}"] = top_operators(
                    runner, inputs, repeats, args.profile
                )
            kernels.set_enabled(True)
    emit({"benchmark": "step", "dtype": llm.engine.core.info.dtype, "steps": results}, args.out)


if __name__ == "__main__":
    main()
