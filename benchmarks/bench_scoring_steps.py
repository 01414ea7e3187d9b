"""What one step costs a decoding neighbour while a long prompt is scored (prompt logprobs), in
the offline engine: a request decodes alone (its step time, median of `--repeats`), then a
7,800-token prompt with prompt logprobs 5 joins it and goes through in chunks of at most 256
scored positions a step; each of those steps is timed (the neighbour decodes in every one).
What bounds the neighbour's gap beside a scoring request: the chunk's own compute, which grows
with its depth in the prompt (attention over the context before it).

  .venv/bin/python benchmarks/bench_scoring_steps.py \
      --out benchmarks/results/hostile/scoring-steps.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.report import emit
from blockserve import LLM, SamplingParams
from blockserve.engine.request import RequestSpec


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--prompt-tokens", type=int, default=7800)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    llm = LLM(dtype=args.dtype)
    engine = llm.engine
    decoding = SamplingParams(max_tokens=4000, ignore_eos=True)
    engine.add_request(RequestSpec("neighbour", "Once upon a time", decoding))
    for _ in range(5):  # past its prefill, decoding
        engine.step()
    alone = []
    for _ in range(args.repeats):
        started = time.perf_counter()
        engine.step()
        alone.append(time.perf_counter() - started)
    prompt = tuple((13 * i + 5) % 40000 + 100 for i in range(args.prompt_tokens))
    scoring = SamplingParams(max_tokens=1, prompt_logprobs=5)
    engine.add_request(RequestSpec("scored", prompt, scoring))
    steps = []
    while "scored" in engine.output_processor:
        started = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - started)
    emit(
        {
            "benchmark": "scoring-steps",
            "dtype": args.dtype,
            "prompt_tokens": args.prompt_tokens,
            "decode_step_alone_s": round(statistics.median(alone), 4),
            "scoring_steps_s": [round(s, 4) for s in steps],
            "first_chunk_s": round(steps[0], 4),
            "last_full_chunk_s": round(steps[-2], 4),
            "max_step_over_alone": round(max(steps) / statistics.median(alone), 1),
        },
        args.out,
    )


if __name__ == "__main__":
    main()
