"""When should decodes read their shared prefix once? A decode step of B sequences over C common
prompt tokens, through the whole engine, with the torch backend's shared-prefix decode path
forced on and forced off (`min_shared_decode_tokens` 0 or unreachable).

The step time is (wall of 17 output tokens − wall of 1) / 16, so prefill and the first token
fall out; the prompts (C shared + 32 own random token ids) are cached before timing. The
default model, the host's `--dtype auto`.

    .venv/bin/python benchmarks/bench_shared_decode.py \
        --out benchmarks/results/shared_decode/shared_decode.json
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path

from report import emit

from blockserve import LLM, SamplingParams

SHAPES = [(2, 1024), (4, 512), (4, 1024), (8, 512), (8, 1024), (8, 2048), (16, 256)]
SHAPES += [(16, 512), (16, 1024), (32, 256), (32, 512), (64, 256), (64, 1024)]
NEVER = 1 << 62


def step_ms(llm: LLM, prompts: list[list[int]]) -> float:
    walls = []
    for tokens in (1, 17):
        params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
        started = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        walls.append(time.perf_counter() - started)
    return (walls[1] - walls[0]) / 16 * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3, help="median of this many")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    llm = LLM(enable_prefix_caching=True, max_num_seqs=64, num_gpu_blocks_override=8192)
    backend = llm.engine.core.runner.backend
    rows = []
    for sequences, common in SHAPES:
        rng = random.Random(sequences * 10_000 + common)
        shared = [rng.randrange(100, 40000) for _ in range(common)]
        prompts = [
            shared + [rng.randrange(100, 40000) for _ in range(32)] for _ in range(sequences)
        ]
        llm.generate(prompts, SamplingParams(max_tokens=1), use_tqdm=False)  # cache the prompts
        row = {"sequences": sequences, "common_tokens": common}
        for path, threshold in (("shared_ms", 0), ("per_sequence_ms", NEVER)):
            backend.min_shared_decode_tokens = threshold
            row[path] = round(
                statistics.median(step_ms(llm, prompts) for _ in range(args.repeats)), 1
            )
        row["saved_reads"] = (sequences - 1) * common
        rows.append(row)
        print(row, flush=True)
    emit(
        {"benchmark": "shared_decode", "dtype": llm.engine.core.info.dtype, "rows": rows}, args.out
    )


if __name__ == "__main__":
    main()
