"""Model-executor speed on the default model, beside transformers' own forward in the same run.

Prefill: tokens/s for one prompt of 512 / 1,024 / 2,048 tokens (one step, fresh cache).
Decode: time of one step at batch 1 / 16 / 64 with 1,024 tokens of context each (one new token
per sequence, logits and sampling included). transformers runs the same inputs with its own KV
cache (DynamicCache pre-filled with 1,024 positions per sequence).

    .venv/bin/python benchmarks/bench_model.py [--dtypes float32 bfloat16] [--out FILE]

Prints one JSON object; medians over --repeats.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from report import emit
from transformers import AutoModelForCausalLM, DynamicCache

from blockserve.config import CacheConfig, ModelConfig
from blockserve.model.arch import LlamaArchConfig
from blockserve.runner.build import build_runner
from blockserve.sampling_params import SamplingParams
from blockserve.sched.output import NewRequestData, ScheduledRequest, SchedulerOutput

BLOCK_SIZE = 16
GREEDY = SamplingParams(temperature=0.0)


def median_time(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def step_for(seqs: list[tuple[str, list[int], int]], new: bool) -> SchedulerOutput:
    """seqs: (request id, token ids to compute, tokens already cached)."""
    scheduled = []
    next_block = 1
    for request_id, tokens, num_cached in seqs:
        total = num_cached + len(tokens)
        num_blocks = -(-total // BLOCK_SIZE)
        block_ids = tuple(range(next_block, next_block + num_blocks))
        next_block += num_blocks
        scheduled.append(
            ScheduledRequest(
                request_id,
                tuple(tokens),
                num_cached,
                block_ids,
                True,
                NewRequestData(tuple(tokens), (), GREEDY) if new else None,
            )
        )
    return SchedulerOutput(tuple(scheduled))


def hf_decode_step_time(
    hf: torch.nn.Module,
    arch: LlamaArchConfig,
    last_tokens: list[int],
    context: int,
    dtype: torch.dtype,
    repeats: int,
) -> float:
    """Median time of one transformers decode step over a cache of `context` positions."""
    shape = (len(last_tokens), arch.num_kv_heads, context, arch.head_dim)
    ids = torch.tensor([[t] for t in last_tokens])
    times = []
    for _ in range(repeats + 1):  # the first is a warm-up
        kv = DynamicCache()
        for layer in range(arch.num_layers):
            kv.update(torch.randn(shape, dtype=dtype), torch.randn(shape, dtype=dtype), layer)
        with torch.inference_mode():
            start = time.perf_counter()
            hf(ids, past_key_values=kv, use_cache=True)
            times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def bench_dtype(dtype: str, repeats: int, hf_model_dir: Path | None) -> dict:
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    runner = build_runner(
        ModelConfig(dtype=dtype), CacheConfig(num_gpu_blocks_override=64 * 65 + 8)
    )
    model_dir = runner.loaded.model_dir
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch_dtype).eval()
    arch = runner.arch
    gen = torch.Generator().manual_seed(0)
    result: dict = {"dtype": dtype, "prefill": [], "decode": []}

    for length in (512, 1024, 2048):
        tokens = torch.randint(0, arch.vocab_size, (length,), generator=gen).tolist()
        ours = median_time(lambda t=tokens: runner.execute(step_for([("p", t, 0)], True)), repeats)
        ids = torch.tensor([tokens])
        with torch.inference_mode():
            theirs = median_time(lambda i=ids: hf(i, use_cache=True), repeats)
        result["prefill"].append(
            {
                "prompt_tokens": length,
                "blockserve_tokens_per_s": round(length / ours),
                "transformers_tokens_per_s": round(length / theirs),
                "speedup": round(theirs / ours, 2),
            }
        )

    context = 1024
    for batch in (1, 16, 64):
        last = torch.randint(0, arch.vocab_size, (batch,), generator=gen).tolist()
        # Decode steps over a cache holding 1,024 positions per sequence (contents do not
        # change the cost, so it is filled at random, as transformers' cache is below).
        for cache in runner.kv_caches:
            cache.normal_()
        seqs = [(f"d{i}", [last[i]], context) for i in range(batch)]
        runner.execute(step_for(seqs, True))
        decode_step = step_for(seqs, False)
        ours = median_time(lambda s=decode_step: runner.execute(s), repeats)

        theirs = hf_decode_step_time(hf, arch, last, context, torch_dtype, repeats)
        result["decode"].append(
            {
                "batch": batch,
                "context_tokens": context,
                "blockserve_step_ms": round(ours * 1e3, 2),
                "transformers_step_ms": round(theirs * 1e3, 2),
                "step_time_ratio": round(ours / theirs, 3),
            }
        )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    results = {
        "benchmark": "model",
        "model": "SmolLM2-135M-Instruct",
        "machine": platform.machine(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "runs": [bench_dtype(dtype, args.repeats, None) for dtype in args.dtypes],
    }
    emit(results, args.out)


if __name__ == "__main__":
    main()
