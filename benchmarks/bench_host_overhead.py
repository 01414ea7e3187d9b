"""The GPU engine's host cost, measured on any CPU: a tiny 16-layer Llama (hidden 64, so its
arithmetic is next to nothing), one torch thread, 256 sequences decoding together. What a
decode step costs here is almost all per-step host work (scheduling, input preparation,
launching ops, sampling, output processing), the part a GPU waits on.

Reports the median decode step's wall time (the engine core's step) and period (from one
step's end to the next's: what the run spends per step, async scheduling's overlap
included), its part outside the model runner, aten ops per step (torch.profiler over 8
full-batch decode steps), and where the median step's time goes (`parts_ms`: scheduling,
input preparation, the forward and within it attention, sampling, and the output processing
that follows the core's step), for the torch backend and float32. On a CPU the forward's
share is mostly arithmetic a GPU does in microseconds; the other parts are host work a GPU
would wait on. `--graph-path` sends decode steps through the CUDA-graph path (static
inputs, buckets) with a replay that computes nothing: what remains is the host's part of a
step whose forward is one replay. `--replay-ms` adds a simulated device that takes that long
per replay while the host goes on, which reading the tokens back waits for.

    .venv/bin/python benchmarks/bench_host_overhead.py [--sequences 256] [--compile]
        [--graph-path [--replay-ms MS]] [--async-scheduling]
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
from blockserve.runner.decode_graphs import (
    DecodeGraphs,
    EagerCapture,
    StaticDecodeInputs,
    graph_batch_sizes,
)
from blockserve.runner.launched import LaunchedStep
from blockserve.runner.model_runner import ModelRunner
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
    # After the core's step returns: counted with the next step (equal in a steady decode).
    parts.wrap(llm.engine.output_processor, "process", "output_processing")
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
    parser.add_argument("--compile", action="store_true", help="the forward as inductor graphs")
    parser.add_argument(
        "--graph-path",
        action="store_true",
        help="decode steps through the CUDA-graph path with a replay that costs nothing: the "
        "host's part of a step when the forward is one graph replay",
    )
    parser.add_argument(
        "--replay-ms",
        type=float,
        default=0.0,
        help="with --graph-path: a device that takes this long per replay, asynchronously",
    )
    parser.add_argument(
        "--async-scheduling",
        action="store_true",
        help="launch each step before the one ahead of it is read back",
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
            compile=args.compile,
        )
        if args.graph_path:
            use_free_replays(llm.engine.core.runner, args.sequences, args.replay_ms / 1e3)
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
                recorder.clear()
                parts.steps.clear()
                llm.generate(prompts, params, use_tqdm=False)
                if run == "timed":
                    timed_parts = decode_parts(recorder, parts, args.sequences)
                    period_s = recorder.decode_period_s(args.sequences)
        llm.shutdown()
    result = {
        "benchmark": "host_overhead",
        "sequences": args.sequences,
        "async_scheduling": args.async_scheduling,
        "compile": args.compile,
        "graph_path": args.graph_path,
        "replay_ms": args.replay_ms,
        "layers": 16,
        "hidden": 64,
        "decode_steps": len(decode),
        "decode_step_ms": round(1e3 * statistics.median(s for s, _ in decode), 2),
        "decode_period_ms": round(1e3 * period_s, 2),
        "outside_runner_ms": None
        if args.async_scheduling
        else round(1e3 * statistics.median(s - r for s, r in decode), 2),
        "aten_ops_per_step": profiled.get("aten_ops_per_step"),
        "parts_ms": timed_parts,
        "torch": torch.__version__,
    }
    emit(result, args.out)


class FreeReplay:
    """A decode graph's stand-in: no plan, and a replay that returns the hidden states it
    would leave (zeros) without computing them. With `device_s`, a device that takes that
    long per replay, one replay after another, asynchronously: the runner's `finish` waits
    until its step's replay would be done, as it waits for a GPU's copy of the tokens."""

    def __init__(self, rows: int, hidden: int, device_s: float) -> None:
        self.hidden = torch.zeros(rows, hidden)
        self.device_s = device_s
        self.free_at = 0.0  # when the simulated device finishes what it was given
        self.replayed = False

    def prepare_decode_graph(self, metadata: object, *heads: int) -> None:
        return None

    def forward(self, ids: torch.Tensor, *rest: object) -> torch.Tensor:
        self.replayed = True
        return self.hidden[: ids.shape[0]]

    def attach(self, runner: ModelRunner) -> None:
        """Time each launched step's replay on the simulated device; `finish` waits for it."""
        launch, finish = runner.launch, runner.finish
        done_at: dict[int, float] = {}

        def timed_launch(scheduler_output: object) -> LaunchedStep:
            self.replayed = False
            step = launch(scheduler_output)
            if self.replayed:
                self.free_at = max(time.perf_counter(), self.free_at) + self.device_s
                done_at[id(step)] = self.free_at
            return step

        def timed_finish(step: LaunchedStep) -> object:
            wait = done_at.pop(id(step), 0.0) - time.perf_counter()
            if wait > 0:
                time.sleep(wait)
            return finish(step)

        runner.launch, runner.finish = timed_launch, timed_finish  # type: ignore[method-assign]


def use_free_replays(runner: ModelRunner, max_num_seqs: int, device_s: float = 0.0) -> None:
    """Decode steps go through the CUDA-graph path (static inputs loaded, the bucket chosen)
    with `FreeReplay`: what is left of a step is the host's part of it with graphs."""
    sizes = graph_batch_sizes(max_num_seqs)
    inputs = StaticDecodeInputs(
        max_batch=sizes[-1], max_blocks=4096 // runner.block_size, block_size=runner.block_size,
        device=runner.device,
    )  # fmt: skip
    graphs = DecodeGraphs(inputs, sizes)
    replay = FreeReplay(sizes[-1], runner.arch.hidden_size, device_s)
    graphs.capture_all(replay.forward, runner.kv_caches, replay, (0, 0, 0), EagerCapture())
    runner.decode_graphs = graphs
    if device_s:
        replay.attach(runner)


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
