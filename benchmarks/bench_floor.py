"""The compute floor of an offline workload on this host, and how near an engine comes.

The floor is the time the workload's arithmetic and memory traffic would take at the best
rates this host reaches, with nothing else in a step:
  - a step's time is at least max(its FLOPs / R_flops, its bytes / R_bytes);
  - R_flops: the best bf16 product rate measured here on the model's four layer products at
    a prefill chunk's 2,048 rows, each shape by whichever of oneDNN's prepacked weight,
    `F.linear` over the plain weight, our AMX tile kernel, oneDNN's over the weight widened
    to float32 (x widened, the sums rounded to bf16), or our half-precision kernel (where the
    CPU has AVX512-FP16; the engine's prefill path there) is fastest on it (the best of 10
    calls);
  - R_bytes: the best read rate measured here: a float32 sum over 1 GiB, or our AMX tile
    kernel's decode products (16 rows) over every layer's weights (the best of 10 each);
  - FLOPs: 2 per weight per token in the linear layers (the LM head's only for the rows
    sampled), and causal attention's 4 · heads · head_dim per (query, key) pair;
  - bytes: every weight once per step, and each decode row's K and V.
The workloads are bench_vs_vllm.py's (32 tokens out, greedy, 2,048 tokens a step).
no-sharing (16 × 544 prompt tokens) is one prefill of 8,704 tokens in chunks of 2,048 whose
last rows sample the first tokens, then 31 decode steps of 16 rows. shared-prefix (64 ×
(1,024 shared + 32 own)) computes the shared prefix once and each request's own 32 tokens
(3,072 in all, each own token seeing the prefix), then 31 decode steps of 64 rows that read
the prefix's K and V once a step. The fraction: floor ÷ the engine's wall time. blockserve's
wall is measured here, the median of 3 (bench_vs_vllm.run_blockserve, the race's call);
`--race FILE` adds those of a bench_vs_vllm.py result. Last, one more run under cProfile
records each torch operator's share of blockserve's wall time (where the rest goes).

    .venv/bin/python benchmarks/bench_floor.py [--model DIR] [--workload shared-prefix]
        [--race FILE] [--out FILE]
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from bench_gemm_peers import best_seconds
from bench_vs_vllm import OUTPUT_TOKENS, WORKLOADS, make_prompts, run_blockserve
from report import emit

from blockserve.config import default_cache_dir
from blockserve.kernels.loader import KernelLoader
from blockserve.model.loader import read_arch, resolve_model_dir
from blockserve.model.packed import wide_linear

CHUNK = 2048  # tokens a step (max_num_batched_tokens)


def product_rates(shapes: list[tuple[int, int]], rows: int) -> dict[str, Any]:
    """Each shape's best time at `rows` rows and by which path; R_flops over them all."""
    ops = KernelLoader().load(default_cache_dir(), torch.bfloat16)
    x_by_k = {k: torch.randn(rows, k).bfloat16() for _, k in shapes}
    per_shape, flops, seconds = {}, 0.0, 0.0
    for n, k in shapes:
        weight = (torch.randn(n, k) * 0.02).bfloat16()
        x = x_by_k[k]
        prepacked = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        paths = {
            "onednn_prepacked": functools.partial(
                torch.ops.mkldnn._linear_pointwise, x, prepacked, None, "none", [], ""
            ),
            "f_linear": functools.partial(F.linear, x, weight),
        }
        if ops is not None and ops.has_amx():
            paths["tile"] = functools.partial(ops.tile_linear, x, ops.tile_pack(weight), None)
        wide = torch.ops.mkldnn._reorder_linear_weight(weight.float(), None)
        paths["wide"] = functools.partial(wide_linear, x, wide, None)
        if ops is not None and ops.has_half() and n % 64 == 0 and k % 32 == 0:
            paths["half"] = functools.partial(ops.half_linear, x, *ops.half_pack(weight), None)
        times = {name: best_seconds(call) for name, call in paths.items()}
        best = min(times, key=times.__getitem__)
        per_shape[f"{n}x{k}"] = {"best": best, **{p: round(t * 1e3, 3) for p, t in times.items()}}
        flops += 2.0 * rows * n * k
        seconds += times[best]
    return {"rows": rows, "per_shape_ms": per_shape, "r_flops": flops / seconds}


def read_rates(shapes: list[tuple[int, int]], layers: int) -> dict[str, float]:
    """Bytes/s read by a float32 sum over 1 GiB, and by our tile kernel's decode products
    (16 rows) over `layers` copies of the layer weights, each its own (out of cache)."""
    big = torch.ones(1 << 28)  # 1 GiB of float32
    rates = {"sum": big.numel() * 4 / best_seconds(lambda: big.sum())}
    ops = KernelLoader().load(default_cache_dir(), torch.bfloat16)
    if ops is not None and ops.has_amx():
        tiles = [ops.tile_pack((torch.randn(n, k) * 0.02).bfloat16()) for n, k in shapes * layers]
        xs = {k: torch.randn(16, k).bfloat16() for _, k in shapes}
        step = best_seconds(lambda: [ops.tile_linear(xs[t.shape[1]], t, None) for t in tiles])
        rates["tile_decode_products"] = sum(t.numel() * 2 for t in tiles) / step
    return rates


def floor_seconds(arch: Any, workload: str, r_flops: float, r_bytes: float) -> dict[str, float]:
    requests, shared, own, _ = WORKLOADS[workload]
    hidden, layers, inter = arch.hidden_size, arch.num_layers, arch.intermediate_size
    q_size, kv_size = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    layer_weights = hidden * (q_size + 2 * kv_size) + q_size * hidden + 3 * hidden * inter
    linear = layers * layer_weights
    head = arch.vocab_size * hidden
    weight_bytes = 2 * (linear + head)
    per_pair = 4 * arch.num_heads * arch.head_dim * layers  # attention FLOPs a (query, key)
    prompt_tokens = shared + requests * own  # a shared prefix computed once
    # (query, key) pairs: the prefix's causal ones, then each own token over the prefix and
    # the own tokens before it
    pairs = shared * (shared + 1) / 2 + requests * (own * shared + own * (own + 1) / 2)
    prefill_flops = 2 * linear * prompt_tokens + 2 * head * requests + per_pair * pairs
    prefill_steps = -(-prompt_tokens // CHUNK)
    prefill = max(prefill_flops / r_flops, prefill_steps * weight_bytes / r_bytes)
    decode = 0.0
    for step in range(1, OUTPUT_TOKENS):
        context = shared + own + step
        flops = 2 * (linear + head) * requests + per_pair * requests * context
        kv_bytes = 2 * 2 * kv_size * layers * (shared + (own + step) * requests)
        decode += max(flops / r_flops, (weight_bytes + kv_bytes) / r_bytes)
    return {"prefill_s": prefill, "decode_s": decode, "floor_s": prefill + decode}


def profile_shares(model_dir: str, workload: str) -> dict[str, Any]:
    """The workload once more under cProfile: each torch operator's share of the wall time
    (its own time; the rest of the step is Python), the largest first."""
    import cProfile
    import pstats

    from blockserve import LLM, SamplingParams

    caching = WORKLOADS[workload][3]
    llm = LLM(model_dir, enable_prefix_caching=caching, max_num_seqs=64, dtype="bfloat16")
    llm.engine.core.runner.kernels.loader.wait()
    prompts = [{"prompt_token_ids": p} for p in make_prompts(workload)]
    params = SamplingParams(temperature=0.0, max_tokens=OUTPUT_TOKENS, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(max_tokens=2), use_tqdm=False)
    if caching:
        llm.reset_prefix_cache()
    profile = cProfile.Profile()
    started = time.perf_counter()
    profile.runcall(llm.generate, prompts, params, use_tqdm=False)
    wall = time.perf_counter() - started
    own: dict[str, float] = {}
    for (_, _, name), row in pstats.Stats(profile).stats.items():  # type: ignore[attr-defined]
        if name.startswith("<built-in method torch._ops."):
            op = name.removeprefix("<built-in method torch._ops.").removesuffix(">")
            own[op] = own.get(op, 0.0) + row[2]
    shares = {op: round(t / wall, 3) for op, t in sorted(own.items(), key=lambda kv: -kv[1])}
    return {"wall_s": round(wall, 3), "operator_shares": shares}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="a Hugging Face directory (default: the embedded model)")
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="no-sharing")
    parser.add_argument("--race", type=Path, help="a bench_vs_vllm.py result with the workload")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/floor/floor.json"))
    args = parser.parse_args()
    model_dir = args.model or str(resolve_model_dir(None))
    arch = read_arch(Path(model_dir))
    shapes = [
        (arch.num_heads * arch.head_dim + 2 * arch.num_kv_heads * arch.head_dim, arch.hidden_size),
        (arch.hidden_size, arch.num_heads * arch.head_dim),
        (2 * arch.intermediate_size, arch.hidden_size),
        (arch.hidden_size, arch.intermediate_size),
    ]
    products = product_rates(shapes, CHUNK)
    reads = read_rates(shapes, arch.num_layers)
    r_bytes = max(reads.values())
    floor = floor_seconds(arch, args.workload, products["r_flops"], r_bytes)
    _, _, _, caching = WORKLOADS[args.workload]
    prompts = make_prompts(args.workload)
    ours = [run_blockserve(model_dir, prompts, caching, "bfloat16", False)["wall_s"] for _ in "abc"]
    walls = {"blockserve": statistics.median(ours)}
    if args.race:
        race = json.loads(args.race.read_text())["workloads"][args.workload]
        engines = [e for e in race if isinstance(race[e], dict)]
        walls.update({f"{engine} (race)": race[engine]["wall_s"] for engine in engines})
    results = {
        "model_dir": model_dir,
        "workload": args.workload,
        "products": {k: v for k, v in products.items() if k != "r_flops"},
        "r_flops_gflops": round(products["r_flops"] / 1e9, 1),
        "r_bytes_gbps": round(r_bytes / 1e9, 1),
        "reads_gbps": {name: round(rate / 1e9, 1) for name, rate in reads.items()},
        **{k: round(v, 3) for k, v in floor.items()},
        "wall_s": walls,
        "blockserve_wall_s_runs": ours,
        "fraction_of_floor": {e: round(floor["floor_s"] / w, 3) for e, w in walls.items()},
        "blockserve_profile": profile_shares(model_dir, args.workload),
    }
    print(json.dumps(results, indent=1), flush=True)
    emit(results, args.out)


if __name__ == "__main__":
    main()
