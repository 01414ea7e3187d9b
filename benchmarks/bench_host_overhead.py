"""The GPU engine's host cost, measured on any CPU: a tiny 16-layer Llama (hidden 64, so its
arithmetic is next to nothing), one torch thread, 256 sequences decoding together. What a
decode step costs here is almost all per-step host work (scheduling, input preparation,
launching ops, sampling, output processing), the part a GPU waits on.

Reports the median decode step's wall time, its part outside the model runner, aten ops per
step (torch.profiler over 8 full-batch decode steps), and where the median step's time goes
(`parts_ms`: scheduling, input preparation, the forward and within it attention, sampling),
for the torch backend and float32. On a CPU the forward's share is mostly arithmetic a GPU
does in microseconds; the other parts are host work a GPU would wait on.

    .venv/bin/python benchmarks/bench_host_overhead.py [--sequences 256] [--async-scheduling]
        [--out FILE]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_gpu_engine import StepRecorder, profiled_decode
from report import emit

from blockserve import LLM, SamplingParams
from tests.tiny_models import save_tiny_model

PROMPT_TOKENS = 32
OUTPUT_TOKENS = 48


class StepParts:
    """Per engine step, the seconds spent in each named call (wrapped on its instance)."""

    def __init__(self) -> None:
        self.steps: list[dict[str, float]] = []
        self._current: dict[str, float] = {}

    def wrap(self, owner: object, name: str, part: str) -> None:
        wrapped: Callable = getattr(owner, name)

        def timed(*args: object, **kwargs: object) -> object:
            start = time.perf_counter()
            try:
                return wrapped(*args, **kwargs)
            finally:
                self._current[part] = self._current.get(part, 0.0) + time.perf_counter() - start

        setattr(owner, name, timed)

    def end_step(self) -> None:
        self.steps.append(self._current)
        self._current = {}


def attach_parts(llm: LLM) -> StepParts:
    """Time the step's parts; a step ends when the core's step returns."""
    parts, core = StepParts(), llm.engine.core
    runner = core.runner
    parts.wrap(core.scheduler, "schedule", "schedule")
    parts.wrap(core.scheduler, "update_from_output", "update_from_output")
    parts.wrap(runner, "prepare_inputs", "prepare_inputs")
    parts.wrap(runner, "forward", "forward")
    parts.wrap(runner.backend, "forward", "attention")
    parts.wrap(runner, "sampler", "sampling")
    step = core.step

    def timed_step() -> object:
        try:
            return step()
        finally:
            parts.end_step()

    core.step = timed_step
    return parts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sequences", type=int, default=256)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument(
        "--async-scheduling",
        action="store_true",
        help="schedule each step while the one before it runs (on a worker thread)",
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        path = save_tiny_model(Path(tmp), num_hidden_layers=16, max_position_embeddings=4096)
        llm = LLM(
            str(path),
            dtype="float32",
            device="cpu",
            attention_backend="torch",
            max_num_seqs=args.sequences,
            max_num_batched_tokens=max(2048, args.sequences * PROMPT_TOKENS),
            num_gpu_blocks_override=args.sequences * 6 + 8,
            async_scheduling=args.async_scheduling,
        )
        recorder = StepRecorder(llm)
        parts = attach_parts(llm)
        prompts = [
            [(7 * i + j) % 300 + 5 for j in range(PROMPT_TOKENS)] for i in range(args.sequences)
        ]
        params = SamplingParams(temperature=0.0, max_tokens=OUTPUT_TOKENS, ignore_eos=True)
        for run in ("warm-up", "timed", "profiled"):  # the profiler slows the steps it sees
            llm.reset_prefix_cache()
            if run == "profiled":
                decode = recorder.decode_steps(args.sequences)
                with profiled_decode(recorder, args.sequences) as profiled:
                    llm.generate(prompts, params, use_tqdm=False)
            else:
                recorder.steps.clear()
                parts.steps.clear()
                llm.generate(prompts, params, use_tqdm=False)
                if run == "timed":
                    timed_parts = decode_parts(recorder, parts, args.sequences)
        llm.shutdown()
    result = {
        "benchmark": "host_overhead",
        "sequences": args.sequences,
        "async_scheduling": args.async_scheduling,
        "layers": 16,
        "hidden": 64,
        "decode_steps": len(decode),
        "decode_step_ms": round(1e3 * statistics.median(s for s, _ in decode), 2),
        "outside_runner_ms": None
        if args.async_scheduling
        else round(1e3 * statistics.median(s - r for s, r in decode), 2),
        # The profiler sees the engine thread's ops, not the pipeline worker's.
        "aten_ops_per_step": None if args.async_scheduling else profiled.get("aten_ops_per_step"),
        "parts_ms": timed_parts,
        "torch": torch.__version__,
    }
    emit(result, args.out)


def decode_parts(recorder: StepRecorder, parts: StepParts, batch: int) -> dict[str, float]:
    """Each part's median ms over the full-batch decode steps of the run just made."""
    decoding = [
        step_parts
        for (tokens, seqs, _, _), step_parts in zip(recorder.steps, parts.steps, strict=True)
        if tokens == seqs == batch
    ]
    names = sorted({name for step_parts in decoding for name in step_parts})
    return {
        name: round(1e3 * statistics.median(p.get(name, 0.0) for p in decoding), 2)
        for name in names
    }


if __name__ == "__main__":
    main()
