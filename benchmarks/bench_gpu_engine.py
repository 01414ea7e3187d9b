"""The whole engine on a GPU: random-init models of real shapes, greedy parity with
transformers, offline throughput, where each decode step's time goes, and each run against
its physical floor.

Models (built here with transformers, random weights, the tests' tokenizer; no model hub):
  smollm2-135m   hidden 576, 30 layers, 9/3 heads, vocab 49,152
  llama-3.2-1b   hidden 2,048, 16 layers, 32/8 heads, vocab 128,256, llama3 rope
  tiny           hidden 64, 2 layers (a smoke run on the CPU: --device cpu --shapes tiny)

Per shape: greedy tokens against transformers' in float32 (4 prompts x 32 tokens), then in
bf16 (float32 on the CPU), greedy, ignore_eos, each workload twice in one process (cold: the
first run after ready; warm: again after a prefix-cache reset):
  shared-prefix  64 x (1,024 shared + 32 distinct) -> 32
  decode-heavy   256 x 512 distinct -> 256 (max_num_seqs 256)

Per run: seconds, output tokens/s, kernels compiled by triton during the run (its
post-compile hook; ready = after `LLM()` returned), the median decode step's wall time and the
part of it spent outside the model runner (scheduler, output processing). On CUDA, a profiled
window of 8 full-batch decode steps (warm run) gives the kernel time per step, the GPU's busy
fraction of a step, and kernel launches per step. The floor: prefill FLOPs / the measured
bf16 matmul rate + each decode step's weight and KV bytes / the measured copy bandwidth.

    python benchmarks/bench_gpu_engine.py [--shapes smollm2-135m llama-3.2-1b]
        [--workloads shared-prefix decode-heavy] [--backend triton] [--device cuda]
        [--enforce-eager] [--async-scheduling] [--runs cold warm] [--out FILE]
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from blockserve import LLM, SamplingParams
from blockserve.kernels.triton_compiles import TritonCompiles
from tests.tiny_models import make_tokenizer

LLAMA_3_ROPE = {
    "rope_type": "llama3",
    "factor": 32.0,
    "high_freq_factor": 4.0,
    "low_freq_factor": 1.0,
    "original_max_position_embeddings": 8192,
}
SHAPES: dict[str, dict[str, Any]] = {
    "smollm2-135m": dict(
        hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, vocab_size=49152, rope_theta=100000.0,
        max_position_embeddings=8192,
    ),
    "llama-3.2-1b": dict(
        hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0, rope_scaling=LLAMA_3_ROPE,
        max_position_embeddings=131072,
    ),
    "tiny": dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=1000, max_position_embeddings=4096,
    ),
}  # fmt: skip


@dataclass(frozen=True)
class Workload:
    requests: int
    shared: int  # tokens every prompt starts with
    distinct: int  # tokens of each prompt's own
    output: int
    max_num_seqs: int

    def prompts(self, vocab_size: int) -> list[list[int]]:
        rng = random.Random(0)
        high = min(vocab_size, 40000)
        prefix = [rng.randrange(100, high) for _ in range(self.shared)]
        return [
            prefix + [rng.randrange(100, high) for _ in range(self.distinct)]
            for _ in range(self.requests)
        ]


KV_CACHE_BYTES = 32 << 30
WORKLOADS = {
    "shared-prefix": Workload(64, 1024, 32, 32, 64),
    "decode-heavy": Workload(256, 0, 512, 256, 256),
}


def save_model(path: Path, shape: str, device: str) -> Path:
    """A random-init Llama of `shape` in bf16 with the tests' tokenizer, as a HF directory."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = make_tokenizer()
    config = LlamaConfig(
        **SHAPES[shape],
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        pad_token_id=None,
        torch_dtype="bfloat16",
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    del model
    return path


def free_device() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def parity(path: Path, device: str, backend: str, vocab_size: int) -> dict[str, Any]:
    """Greedy tokens of blockserve and transformers, float32, 4 prompts x 32 tokens."""
    from transformers import LlamaForCausalLM

    rng = random.Random(1)
    prompts = [
        [rng.randrange(100, min(vocab_size, 40000)) for _ in range(n)] for n in (7, 33, 70, 150)
    ]
    model = LlamaForCausalLM.from_pretrained(path, torch_dtype=torch.float32).to(device).eval()
    expected = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt], device=device)
            out = model.generate(ids, max_new_tokens=32, do_sample=False, min_new_tokens=32)
            expected.append(out[0, len(prompt) :].tolist())
    del model
    free_device()
    llm = LLM(
        str(path), dtype="float32", device=device, attention_backend=backend,
        max_model_len=2048, kv_cache_memory_bytes=KV_CACHE_BYTES if device == "cuda" else None,
    )  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    llm.shutdown()
    del llm
    free_device()
    equal = sum(
        a == b for g, e in zip(got, expected, strict=True) for a, b in zip(g, e, strict=True)
    )
    return {"tokens_equal": equal, "tokens": 32 * len(prompts)}


class StepRecorder:
    """Wraps the engine core's step, its scheduler's schedule and its runner's execute: per
    step, the batch scheduled, the step's wall time and the runner's. Under async scheduling
    a step launches the batch it schedules and finishes the one before: the runner's time is
    not one step's part, and is left at 0."""

    def __init__(self, llm: LLM) -> None:
        self.core = llm.engine.core
        self.asynchronous = self.core.scheduler_config.async_scheduling
        self.steps: list[tuple[int, int, float, float]] = []  # tokens, seqs, step s, runner s
        self.ends: list[float] = []  # when each step returned
        self.profile_at: int | None = None
        self.profiled: list[Any] = []
        self._runner_s = 0.0
        self._shape = (0, 0)
        execute, step = self.core.runner.execute, self.core.step
        schedule = self.core.scheduler.schedule

        def timed_schedule() -> Any:
            output = schedule()
            self._shape = (output.num_scheduled_tokens, len(output.scheduled))
            return output

        def timed_execute(scheduler_output: Any) -> Any:
            start = time.perf_counter()
            try:
                return execute(scheduler_output)
            finally:
                if not self.asynchronous:
                    self._runner_s = time.perf_counter() - start

        def timed_step() -> Any:
            self._runner_s, self._shape = 0.0, (0, 0)
            start = time.perf_counter()
            result = step()
            self.ends.append(time.perf_counter())
            self.steps.append((*self._shape, self.ends[-1] - start, self._runner_s))
            return result

        self.core.scheduler.schedule = timed_schedule
        self.core.runner.execute = timed_execute
        self.core.step = timed_step

    def decode_steps(self, batch: int) -> list[tuple[float, float]]:
        """(step s, runner s) of the steps that decoded `batch` sequences and nothing else."""
        return [(s, r) for tokens, seqs, s, r in self.steps if tokens == seqs == batch]

    def decode_period_s(self, batch: int) -> float:
        """The median time from one full-batch decode step's end to the next's: a step's
        share of the run's time, with whatever the engine does between steps (output
        processing) and whatever async scheduling overlaps."""
        periods = [
            self.ends[k] - self.ends[k - 1]
            for k in range(1, len(self.steps))
            if self.steps[k][:2] == self.steps[k - 1][:2] == (batch, batch)
        ]
        return statistics.median(periods) if periods else float("nan")

    def clear(self) -> None:
        self.steps.clear()
        self.ends.clear()

    def largest_decode_batch(self) -> int:
        return max((seqs for tokens, seqs, _, _ in self.steps if tokens == seqs), default=0)


@contextmanager
def profiled_decode(recorder: StepRecorder, batch: int, steps: int = 8) -> Iterator[dict]:
    """Profile `steps` full-batch decode steps from the 4th on; yields the figures after."""
    from torch.profiler import ProfilerActivity, profile

    figures: dict[str, Any] = {}
    step = recorder.core.step
    seen = [0]
    cuda = torch.cuda.is_available()
    profiler = profile(
        activities=[ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    )

    def wrapped() -> Any:
        decoding = recorder.steps and recorder.steps[-1][:2] == (batch, batch)
        seen[0] += 1 if decoding else 0
        if seen[0] == 4 and not figures.get("started"):
            figures["started"] = True
            profiler.__enter__()
        result = step()
        if figures.get("started") and not figures.get("stopped") and seen[0] >= 4 + steps:
            if cuda:
                torch.cuda.synchronize()
            profiler.__exit__(None, None, None)
            figures["stopped"] = True
        return result

    recorder.core.step = wrapped
    try:
        yield figures
    finally:
        recorder.core.step = step
    if figures.get("stopped"):
        events = profiler.events()
        kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
        launches = [e for e in events if "LaunchKernel" in e.name or e.name == "cudaGraphLaunch"]
        figures["kernel_ms_per_step"] = round(sum(e.device_time for e in kernels) / 1e3 / steps, 3)
        figures["launches_per_step"] = round(len(launches) / steps, 1)
        figures["aten_ops_per_step"] = round(
            sum(e.name.startswith("aten::") for e in events) / steps, 1
        )


def floor_seconds(config: dict[str, Any], work: Workload, peaks: dict[str, float]) -> float:
    """Prefill FLOPs at the matmul peak plus each decode step's bytes at the copy bandwidth."""
    hidden, layers = config["hidden_size"], config["num_hidden_layers"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = hidden // heads
    inter, vocab = config["intermediate_size"], config["vocab_size"]
    layer_params = hidden * (heads + 2 * kv_heads) * head_dim + heads * head_dim * hidden
    layer_params += 3 * hidden * inter
    params = layers * layer_params + vocab * hidden  # tied: the embedding is the lm_head
    computed = work.shared + work.requests * work.distinct  # prompt tokens (prefix cached)
    pairs = work.shared * (work.shared + 1) // 2 + work.requests * (
        work.distinct * work.shared + work.distinct * (work.distinct + 1) // 2
    )
    flops = 2 * layers * layer_params * computed + 4 * layers * heads * head_dim * pairs
    flops += 2 * vocab * hidden * work.requests  # logits of each prompt's last token
    kv_per_token = layers * 2 * kv_heads * head_dim * 2
    prompt = work.shared + work.distinct
    decode_bytes = sum(
        2 * params + work.requests * (prompt + step) * kv_per_token
        for step in range(1, work.output)
    )
    copy = peaks["copy_gb_per_s"] * 1e9 / 2  # the copy rate counts read + write
    return flops / (peaks["bf16_matmul_tflops"] * 1e12) + decode_bytes / copy


def run_workload(
    path: Path, name: str, args: argparse.Namespace, peaks: dict[str, float] | None
) -> dict[str, Any]:
    work = WORKLOADS[name]
    dtype = "bfloat16" if args.device == "cuda" else "float32"
    started = time.perf_counter()
    llm = LLM(
        str(path),
        # the default 2 GiB would hold a third of decode-heavy's 256 x 768 tokens (1B shape)
        kv_cache_memory_bytes=KV_CACHE_BYTES if args.device == "cuda" else None,
        dtype=dtype,
        device=args.device,
        attention_backend=args.backend,
        max_model_len=2048,
        max_num_seqs=work.max_num_seqs,
        enforce_eager=args.enforce_eager,
        async_scheduling=args.async_scheduling,
    )
    result: dict[str, Any] = {
        "workload": name,
        "ready_s": round(time.perf_counter() - started, 2),
        "cuda_graphs": llm.engine.core.info.runtime.get("cuda_graphs", 0),
    }
    recorder = StepRecorder(llm)
    config = json.loads((path / "config.json").read_text())
    prompts = work.prompts(config["vocab_size"])
    params = SamplingParams(temperature=0.0, max_tokens=work.output, ignore_eos=True)
    with TritonCompiles() as compiles:
        compiled = compiles.kernels
        for label in args.runs:
            llm.reset_prefix_cache()
            recorder.clear()
            before = len(compiled)
            with profiled_decode(recorder, work.requests) if label == "warm" else _none() as prof:
                start = time.perf_counter()
                outputs = llm.generate(prompts, params, use_tqdm=False)
                seconds = time.perf_counter() - start
            tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
            batch = recorder.largest_decode_batch()
            decode = recorder.decode_steps(batch)
            run = {
                "decode_batch": batch,
                "seconds": round(seconds, 3),
                "output_tokens_per_s": round(tokens / seconds, 1),
                "steps": len(recorder.steps),
                "compilations": len(compiled) - before,
                "compiled": compiled[before:][:10],
            }
            if decode:
                run["decode_step_ms"] = round(1e3 * statistics.median(s for s, _ in decode), 2)
                run["decode_period_ms"] = round(1e3 * recorder.decode_period_s(batch), 2)
                if not recorder.asynchronous:
                    run["decode_outside_runner_ms"] = round(
                        1e3 * statistics.median(s - r for s, r in decode), 2
                    )
            if prof and "launches_per_step" in prof:
                run.update({k: v for k, v in prof.items() if k not in ("started", "stopped")})
                if decode and args.device == "cuda":
                    run["gpu_busy_of_step"] = round(
                        prof["kernel_ms_per_step"] / run["decode_step_ms"], 3
                    )
            if peaks:
                floor = floor_seconds(config, work, peaks)
                run["floor_s"] = round(floor, 3)
                run["of_floor"] = round(floor / seconds, 3)
            result[label] = run
            print(json.dumps({name: {label: run}}), flush=True)
    llm.shutdown()
    del llm, recorder
    free_device()
    return result


@contextmanager
def _none() -> Iterator[None]:
    yield None


def device_peaks() -> dict[str, float]:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_attention import device_peaks as measure

    return measure()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", nargs="+", default=["smollm2-135m", "llama-3.2-1b"])
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    parser.add_argument("--backend", default="triton")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--no-parity", action="store_true")
    parser.add_argument(
        "--enforce-eager", action="store_true", help="decode steps eager, no CUDA graphs"
    )
    parser.add_argument(
        "--async-scheduling", action="store_true", help="schedule while the step before runs"
    )
    parser.add_argument(
        "--runs", nargs="+", default=["cold", "warm"], choices=["cold", "warm"],
        help="runs of each workload: cold (first after ready), warm (after it when both; profiled)",
    )  # fmt: skip
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/gpu/engine.json"))
    args = parser.parse_args()
    peaks = device_peaks() if args.device == "cuda" else None
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "torch": torch.__version__,
        "backend": args.backend,
        "cuda_graphs": not args.enforce_eager,
        "async_scheduling": args.async_scheduling,
        "peaks": peaks,
        "shapes": {},
    }
    failed: dict[str, str] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for shape in args.shapes:
            started = time.perf_counter()
            entry: dict[str, Any] = {}
            try:
                path = save_model(Path(tmp) / shape, shape, args.device)
                entry["built_s"] = round(time.perf_counter() - started, 1)
                if not args.no_parity:
                    entry["parity"] = parity(
                        path, args.device, args.backend, SHAPES[shape]["vocab_size"]
                    )
                    print(json.dumps({shape: entry}), flush=True)
                for name in args.workloads:
                    entry[name] = run_workload(path, name, args, peaks)
            except Exception as error:  # report what ran; the check goes on to the next shape
                failed[shape] = repr(error)[:800]
                print(f"{shape} failed: {error!r}", flush=True)
            entry["seconds"] = round(time.perf_counter() - started, 1)
            report["shapes"][shape] = entry
            report["failed"] = failed
            args.out.parent.mkdir(parents=True, exist_ok=True)  # after each shape: a check's
            args.out.write_text(json.dumps(report, indent=2) + "\n")  # time cap keeps some
    print_table(report)


def print_table(report: dict[str, Any]) -> None:
    print(f"\n{report['device']}, torch {report['torch']}, backend {report['backend']}")
    print(
        f"{'shape':14} {'workload':14} {'run':5} {'s':>7} {'tok/s':>9} {'step ms':>8} "
        f"{'period':>8} {'outside':>8} {'kern ms':>8} {'busy':>8} {'launch':>8} {'comp':>8} "
        f"{'floor':>8}"
    )
    for shape, entry in report["shapes"].items():
        if "parity" in entry:
            p = entry["parity"]
            print(
                f"{shape:14} parity (float32, vs transformers): {p['tokens_equal']}/{p['tokens']}"
            )
        for name in WORKLOADS:
            for label in ("cold", "warm"):
                run: dict[str, Any] = entry.get(name, {}).get(label)
                if run is None:
                    continue
                cells = [run.get(k, "-") for k in ("decode_step_ms", "decode_period_ms",
                         "decode_outside_runner_ms",
                         "kernel_ms_per_step", "gpu_busy_of_step", "launches_per_step",
                         "compilations", "of_floor")]  # fmt: skip
                print(
                    f"{shape:14} {name:14} {label:5} {run['seconds']:>7} "
                    f"{run['output_tokens_per_s']:>9} " + " ".join(f"{c!s:>8}" for c in cells)
                )


if __name__ == "__main__":
    main()
