"""LoRA's cost in a decode step: the embedded model decoding a batch of 64 requests, spread
over 8 adapters (rank 16, all seven projections, random weights written in PEFT's format), and
the same batch on the base model, in turn `--repeats` times; the median full-batch decode step
of each (medians of the runs), and the ratio.

    .venv/bin/python benchmarks/bench_lora.py [--dtype auto|float32] [--adapters 8]
        [--batch 64] [--rank 16] [--torch-products] [--profile] [--out FILE]
    .venv/bin/python benchmarks/bench_lora.py --first-load [--batch 16] [--rounds 6]
    .venv/bin/python benchmarks/bench_lora.py --serving [--adapters 8]

`--profile` also prints torch.profiler's table of one full-batch step under the adapters.
`--first-load`: a batch of base-model requests decoding when, round after round, a request
arrives for an adapter that has left host memory: its TTFT and read time, and the batch's step
time (its TPOT) before and while the adapter is read. `--serving`: a multi-turn chat load
against a real server of the base model alone, then of 8 adapters with the conversations
spread over them: throughput and the hit rate within each adapter.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_gpu_engine import StepRecorder
from report import emit

from blockserve import LLM, LoRARequest, SamplingParams
from blockserve.bench.load import run_load, summarize
from blockserve.bench.serve import add_arguments, server_hit_rate
from blockserve.bench.server_process import ServerProcess
from blockserve.engine.llm_engine import LLMEngine
from blockserve.engine.request import RequestSpec
from blockserve.lora.adapter import MODULES, module_shapes
from blockserve.model.arch import LlamaArchConfig

DECODE_TOKENS = 48
# --serving's load: 32 chat conversations of 4 turns (each resends its history), 16 at a time.
SERVING_LOAD = ["--dataset", "multi-turn", "--num-prompts", "32", "--turns", "4",
                "--question-len", "64", "--output-len", "32", "--concurrency", "16"]  # fmt: skip


def write_adapter(path: Path, arch: LlamaArchConfig, rank: int, seed: int) -> Path:
    """A PEFT-format adapter on every projection of every layer, random A and B."""
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(arch.num_layers):
        for module, (fan_in, fan_out) in module_shapes(arch).items():
            part = "self_attn" if module in MODULES[:4] else "mlp"
            key = f"base_model.model.model.layers.{layer}.{part}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=generator) * 0.02
            tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=generator) * 0.02
    path.mkdir(parents=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    config = {"r": rank, "lora_alpha": rank, "target_modules": list(MODULES), "bias": "none"}
    (path / "adapter_config.json").write_text(json.dumps(config))
    return path


def decode_step_ms(llm: LLM, batch: int, loras: list[LoRARequest | None]) -> float:
    """The median step that decodes the whole batch (prefills excluded)."""
    recorder = StepRecorder(llm)
    prompts = [[(7 * i + j) % 1000 + 5 for j in range(32)] for i in range(batch)]
    params = SamplingParams(temperature=0, max_tokens=DECODE_TOKENS, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False,
                 lora_request=loras)  # fmt: skip
    full = [s for tokens, seqs, s, _ in recorder.steps if seqs == batch and tokens == batch]
    return 1000 * statistics.median(full)


def profile_step(llm: LLM, batch: int, loras: list[LoRARequest]) -> str:
    """torch.profiler's table (top ops by self time) of one full-batch decode step."""
    runner = llm.engine.core.runner
    execute, tables = runner.execute, []

    def profiled(scheduler_output: Any) -> Any:
        full = len(scheduler_output.scheduled) == scheduler_output.num_scheduled_tokens == batch
        if not full or tables:
            return execute(scheduler_output)
        with torch.profiler.profile() as prof:
            result = execute(scheduler_output)
        tables.append(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))
        return result

    runner.execute = profiled  # type: ignore[method-assign]
    decode_step_ms(llm, batch, loras)  # type: ignore[arg-type]
    runner.execute = execute  # type: ignore[method-assign]
    return tables[0]


def timed_steps(engine: LLMEngine, until: Any, bound: int) -> tuple[list[float], list[Any]]:
    """Step until `until(outputs)` holds (at most `bound` steps): each step's seconds, and
    the outputs of the last."""
    seconds, outputs = [], []
    for _ in range(bound):
        start = time.perf_counter()
        outputs = engine.step()
        seconds.append(time.perf_counter() - start)
        if until(outputs):
            break
    return seconds, outputs


def first_load(dtype: str, batch: int, rank: int, rounds: int, root: Path) -> dict[str, Any]:
    """`batch` base-model requests decoding; in each round one request (4 tokens) for the
    adapter that has left host memory (one slot, host room for one adapter, two adapters
    taking turns): the batch's steps before it and while it is read, its read and TTFT."""
    arch = LLM(dtype=dtype).engine.core.runner.arch  # the shapes, from a plain engine
    names = ("a", "b")
    modules = tuple(
        f"{n}={write_adapter(root / n, arch, rank, seed)}" for seed, n in enumerate(names)
    )
    llm = LLM(dtype=dtype, enable_lora=True, max_loras=1, max_cpu_loras=1, max_lora_rank=rank,
              max_num_seqs=batch + 1, lora_modules=modules)  # fmt: skip
    llm.engine.core.runner.kernels.loader.wait()
    engine, host = llm.engine, llm.engine.lora_manager().host
    params = SamplingParams(temperature=0, max_tokens=100 * rounds, ignore_eos=True)
    prompts = [[(7 * i + j) % 1000 + 5 for j in range(32)] for i in range(batch + 1)]
    for i in range(batch):
        engine.add_request(RequestSpec(f"b{i}", prompts[i], params))
    timed_steps(engine, lambda outputs: False, 12)  # prefills, then decodes
    before, reading, admitting, reads = [], [], [], []
    for turn in range(rounds):
        before += timed_steps(engine, lambda outputs: False, 10)[0]
        name, loads = names[turn % 2], host.loads  # `a` left host memory when `b` came in
        added = time.perf_counter()
        engine.add_request(RequestSpec(f"cold{turn}", prompts[batch], SamplingParams(
            temperature=0, max_tokens=4, ignore_eos=True), lora_name=name))  # fmt: skip
        steps, _ = timed_steps(engine, lambda outputs, loads=loads: host.loads > loads, 200)
        reading += steps[:-1]  # the last step admitted it: its slot and its prefill
        admitting.append(steps[-1])
        reads.append({"steps": len(steps) - 1, "ttft_s": round(time.perf_counter() - added, 3)})
        timed_steps(engine, lambda outputs, cold=f"cold{turn}": any(
            o.request_id == cold and o.finished for o in outputs), 20)  # fmt: skip
    base, during = statistics.mean(before), statistics.mean(reading)
    return {
        "batch": batch,
        "rank": rank,
        "rounds": reads,
        "read_s_mean": round(host.load_seconds / max(host.loads, 1), 3),
        "step_ms_before": round(1000 * base, 2),
        "step_ms_while_reading": round(1000 * during, 2),
        "tpot_ratio_while_reading": round(during / base, 3),
        "median_ratio_while_reading": round(
            statistics.median(reading) / statistics.median(before), 3
        ),
        "admitting_step_ms": [round(1000 * s, 1) for s in admitting],
    }


def serving(rank: int, adapters: int, root: Path, load_args: list[str]) -> dict[str, Any]:
    """The same multi-turn chat load against a server of the base model alone, then one
    serving `adapters` adapters with the conversations spread over them."""
    arch = LLM().engine.core.runner.arch  # the shapes, from a plain engine
    modules = [f"a{i}={write_adapter(root / f'a{i}', arch, rank, i)}" for i in range(adapters)]
    lora_flags = ["--enable-lora", "--max-loras", str(adapters), "--max-lora-rank", str(rank),
                  "--lora-modules", *modules]  # fmt: skip
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    runs = {}
    names = [f"a{i}" for i in range(adapters)]
    for label, flags, spread in (("base model alone", [], []),
                                 (f"{adapters} adapters", lora_flags, names)):  # fmt: skip
        args = parser.parse_args([*load_args, *(["--lora-modules", *spread] if spread else [])])
        server = ServerProcess(flags, root / f"server-{len(runs)}.log")
        try:
            results, wall = asyncio.run(run_load(args, server.url))
            run = summarize(results, wall, server_hit_rate(server.url))
        finally:
            server.stop()
        runs[label] = {k: v for k, v in run.items() if k != "ttft_samples_s"}
    base, lora = runs.values()
    return {
        "load": " ".join(load_args),
        "runs": runs,
        "throughput_ratio": round(lora["output_tokens_per_s"] / base["output_tokens_per_s"], 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--first-load", action="store_true")
    parser.add_argument("--rounds", type=int, default=6, help="of --first-load")
    parser.add_argument("--serving", action="store_true")
    parser.add_argument("--repeats", type=int, default=3, help="base and LoRA runs, in turn")
    parser.add_argument("--torch-products", action="store_true",
                        help="LoRA's products as torch's bmm, not our CPU kernel")  # fmt: skip
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.first_load:
        with tempfile.TemporaryDirectory() as root:
            result = first_load(args.dtype, args.batch, args.rank, args.rounds, Path(root))
        emit({"benchmark": "lora_first_load", "dtype": args.dtype, **result}, args.out)
        return
    if args.serving:
        with tempfile.TemporaryDirectory() as root:
            result = serving(args.rank, args.adapters, Path(root), SERVING_LOAD)
        emit({"benchmark": "lora_serving", "rank": args.rank, "adapters": args.adapters,
              **result}, args.out)  # fmt: skip
        return
    llm = LLM(dtype=args.dtype, enable_lora=True, max_loras=args.adapters, max_lora_rank=args.rank,
              max_num_seqs=args.batch)  # fmt: skip
    arch = llm.engine.core.runner.arch
    kernels = llm.engine.core.runner.kernels
    kernels.loader.wait()  # a host's first build runs while it starts
    kernels.switches.lora = not args.torch_products
    with tempfile.TemporaryDirectory() as root:
        loras = [
            LoRARequest(
                f"a{i}", i + 1, str(write_adapter(Path(root) / f"a{i}", arch, args.rank, i))
            )
            for i in range(args.adapters)
        ]
        per_request = [loras[i % args.adapters] for i in range(args.batch)]
        decode_step_ms(llm, args.batch, [None] * args.batch)  # warm: kernels, pages
        base, lora = [], []
        for _ in range(args.repeats):  # taking turns: a slower spell of the host hits both
            base.append(decode_step_ms(llm, args.batch, [None] * args.batch))
            lora.append(decode_step_ms(llm, args.batch, per_request))  # type: ignore[arg-type]
        if args.profile:
            print(profile_step(llm, args.batch, per_request))
    base_ms, lora_ms = statistics.median(base), statistics.median(lora)
    emit(
        {
            "benchmark": "lora",
            "dtype": str(llm.engine.core.runner.kv_caches[0].dtype),
            "batch": args.batch,
            "adapters": args.adapters,
            "rank": args.rank,
            "lora_products": "torch bmm" if args.torch_products else "ours (csrc/cpu/lora.h)",
            "base_step_ms": round(base_ms, 2),
            "lora_step_ms": round(lora_ms, 2),
            "ratio": round(lora_ms / base_ms, 3),
            "base_runs_ms": [round(ms, 2) for ms in base],
            "lora_runs_ms": [round(ms, 2) for ms in lora],
        },
        args.out,
    )


if __name__ == "__main__":
    main()
