"""Where one engine step's time goes: torch.profiler over step `--step` of the offline
shared-prefix workload (64 x (1,024 shared + 32 own) prompt tokens, 12 greedy tokens out, after a
warm-up on other tokens), the operators by their own time. Step 1 is the first prefill chunk
(2,048 tokens), step 6 a 64-sequence decode step.

    .venv/bin/python benchmarks/profile_step.py [--model DIR|llama-3.2-1b-shape] [--step 6]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from model_shapes import SHAPES
from model_shapes import model_dir as shaped_model_dir
from report import emit


def main() -> None:
    import torch

    from blockserve import LLM, SamplingParams

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="default: the embedded model")
    parser.add_argument("--step", type=int, default=6)
    parser.add_argument("--top", type=int, default=8)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    model = str(shaped_model_dir(args.model)) if args.model in SHAPES else args.model
    llm = LLM(model=model)
    llm.engine.core.runner.kernels.loader.wait()  # a first start builds them meanwhile
    shared = list(range(100, 1124))
    prompts = [shared + [2000 + i * 32 + j for j in range(32)] for i in range(64)]
    llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=2), use_tqdm=False)
    runner = llm.engine.core.runner
    execute = runner.execute
    seen: dict[str, Any] = {"steps": 0}

    def profiled(output: Any) -> Any:
        seen["steps"] += 1
        if seen["steps"] != args.step:
            return execute(output)
        started = time.perf_counter()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            result = execute(output)
        seen["step_ms"] = round((time.perf_counter() - started) * 1e3, 1)
        seen["tokens"], seen["sequences"] = output.num_scheduled_tokens, len(output.scheduled)
        seen["profile"] = prof
        return result

    runner.execute = profiled
    llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    averages = sorted(seen["profile"].key_averages(), key=lambda e: -e.self_cpu_time_total)
    total = sum(e.self_cpu_time_total for e in averages)
    emit(
        {
            "benchmark": "profile_step",
            "model": model or "embedded SmolLM2-135M-Instruct",
            "step": args.step,
            "tokens": seen["tokens"],
            "sequences": seen["sequences"],
            "step_ms": seen["step_ms"],
            "operators": [
                {
                    "name": e.key,
                    "calls": e.count,
                    "self_ms": round(e.self_cpu_time_total / 1e3, 1),
                    "share": round(e.self_cpu_time_total / total, 3),
                }
                for e in averages[: args.top]
            ],
        },
        args.out,
    )


if __name__ == "__main__":
    main()
