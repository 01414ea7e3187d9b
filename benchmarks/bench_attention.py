"""Attention kernels on a CUDA device: decode bandwidth and prefill-on-prefix FLOP rate.

Decode: batch 1 / 64 / 256 sequences, context 1k / 8k, one query each; achieved bandwidth =
K and V bytes read / time of the backend's forward (K/V write included), against the device's
measured copy bandwidth. Prefill-on-prefix: 512 new tokens on top of a cached 1k / 8k context;
achieved FLOP/s (QK^T and PV, causal over the new tokens) against the device's measured bf16
matmul rate. bf16, 32 query heads, 8 KV heads, head_dim 128, block size 16; each sequence's
blocks are scattered over the cache at random.

Prefill on a prefix also through torch's SDPA (causal from the bottom right) over the
sequence's blocks gathered whole, the other path for it. The JSON is written after each
measurement, so a time cap keeps what ran.

--sweep also times the triton kernel's launch parameters (keys per tile, warps, pipeline
stages) at decode batch 64 / 8k and prefill 512 on 8k, and decode batch 1 / 8k with and without
KV splits, so one run on a GPU shows which configuration to ship.

    python benchmarks/bench_attention.py [--backends triton cuda torch] [--sweep] [--out FILE]
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from blockserve.attention.selector import get_attention_backend
from blockserve.attention.triton_backend import unified_attention
from blockserve.attention.triton_plan import KernelConfig, TritonAttentionPlan
from tests.attention.cases import make_bench_case  # random paged cases, built on the device

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
PREFILL_TOKENS = 512


def cuda_time(fn: Callable[[], object], repeats: int = 20) -> float:
    """Median seconds of `fn` on the device (CUDA events), after one warm-up call."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def device_peaks() -> dict[str, float]:
    """Copy bandwidth (bytes read + written) and bf16 matmul rate, measured here."""
    src = torch.empty(1 << 28, dtype=torch.bfloat16, device="cuda")  # 512 MiB
    dst = torch.empty_like(src)
    copy_s = cuda_time(lambda: dst.copy_(src))
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    matmul_s = cuda_time(lambda: a @ a)
    return {
        "copy_gb_per_s": 2 * src.numel() * 2 / copy_s / 1e9,
        "bf16_matmul_tflops": 2 * 8192**3 / matmul_s / 1e12,
    }


def time_backend(backend_name: str, specs: list[tuple[int, int]]) -> float:
    query, key, value, kv_cache, metadata = make_bench_case(specs, HEADS, KV_HEADS, HEAD_DIM)
    backend = get_attention_backend(backend_name, "cuda")
    plan = backend.prepare(metadata)
    return cuda_time(lambda: backend.forward(query, key, value, kv_cache, plan))


def time_triton(
    specs: list[tuple[int, int]], config: KernelConfig | None, num_splits: int | None
) -> float:
    """The triton attention kernel alone (K/V already written) with the given parameters."""
    query, _, _, kv_cache, metadata = make_bench_case(specs, HEADS, KV_HEADS, HEAD_DIM)
    plan = TritonAttentionPlan(metadata)
    out = torch.empty_like(query)
    return cuda_time(lambda: unified_attention(query, kv_cache, plan, out, num_splits, config))


def time_sdpa_prefill(context: int) -> float:
    """The other path issue 46 names for prefill on a cached prefix: the sequence's blocks
    gathered whole, then torch's SDPA causal from the bottom right (its flash kernel where
    it takes one), the gather timed with it."""
    from torch.nn.attention.bias import causal_lower_right

    specs = [(context, PREFILL_TOKENS)]
    query, _, _, kv_cache, metadata = make_bench_case(specs, HEADS, KV_HEADS, HEAD_DIM)
    total = context + PREFILL_TOKENS
    table = metadata.block_tables[0]
    mask = causal_lower_right(PREFILL_TOKENS, total)
    q = query.transpose(0, 1).unsqueeze(0)  # [1, heads, tokens, dim]

    def run() -> torch.Tensor:
        k, v = (cache[table].flatten(0, 1)[:total].transpose(0, 1)[None] for cache in kv_cache)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)

    return cuda_time(run)


def decode_bytes(batch: int, context: int) -> int:
    return batch * (context + 1) * KV_HEADS * HEAD_DIM * 2 * 2  # K and V, bf16


def prefill_flops(context: int) -> int:
    return 4 * HEADS * HEAD_DIM * PREFILL_TOKENS * (context + PREFILL_TOKENS // 2)


def decode_row(peaks: dict[str, float], batch: int, context: int, seconds: float) -> dict:
    bandwidth = decode_bytes(batch, context) / seconds / 1e9
    return {
        "kind": "decode",
        "batch": batch,
        "context": context,
        "us": round(seconds * 1e6, 1),
        "achieved": round(bandwidth, 1),
        "unit": "GB/s",
        "of_peak": round(bandwidth / peaks["copy_gb_per_s"], 3),
    }


def prefill_row(peaks: dict[str, float], context: int, seconds: float) -> dict:
    tflops = prefill_flops(context) / seconds / 1e12
    return {
        "kind": "prefill_on_prefix",
        "batch": 1,
        "context": context,
        "us": round(seconds * 1e6, 1),
        "achieved": round(tflops, 2),
        "unit": "TFLOP/s",
        "of_peak": round(tflops / peaks["bf16_matmul_tflops"], 3),
    }


def sweep(
    peaks: dict[str, float],
    save: Callable[[list[dict[str, Any]]], None],
    batch: int = 64,
    context: int = 8192,
) -> list[dict[str, Any]]:
    """Triton launch parameters at the shapes the goals name (decode batch 64, 8k context);
    `save` is handed the rows so far after each."""
    rows: list[dict[str, Any]] = []
    for tile_n, warps, stages in itertools.product((32, 64, 128), (4, 8), (2, 3, 4)):
        config = KernelConfig(tile_n, warps, stages)
        label = {"backend": "triton", "tile_n": tile_n, "num_warps": warps, "num_stages": stages}
        for specs in ([(context, 1)] * batch, [(context, PREFILL_TOKENS)]):
            try:
                seconds = time_triton(specs, config, None)
            except Exception as error:  # e.g. more shared memory than a block may have
                rows.append({**label, "specs": str(specs[0]), "error": repr(error)[:200]})
            else:
                if specs[0][1] == 1:
                    rows.append({**label, **decode_row(peaks, batch, context, seconds)})
                else:
                    rows.append({**label, **prefill_row(peaks, context, seconds)})
            print(json.dumps(rows[-1]), flush=True)
            save(rows)
    for splits in (1, 4, 16, 32, None):
        seconds = time_triton([(context, 1)], None, splits)
        row = {"backend": "triton", "num_splits": splits or "auto"}
        rows.append({**row, **decode_row(peaks, 1, context, seconds)})
        print(json.dumps(rows[-1]), flush=True)
        save(rows)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backends", nargs="+", default=["triton", "cuda", "torch"])
    parser.add_argument("--sweep", action="store_true", help="also time triton's parameters")
    out = Path("benchmarks/results/attention/attention.json")
    parser.add_argument("--out", type=Path, default=out)
    args = parser.parse_args()
    started = time.perf_counter()
    failed: dict[str, str] = {}
    peaks = device_peaks()
    print(json.dumps(peaks), flush=True)
    rows: list[dict[str, Any]] = []
    for backend_name in args.backends:
        try:
            for context in (1024, 8192):
                for batch in (1, 64, 256):
                    seconds = time_backend(backend_name, [(context, 1)] * batch)
                    row = decode_row(peaks, batch, context, seconds)
                    rows.append({"backend": backend_name, **row})
                    print(json.dumps(rows[-1]), flush=True)
                seconds = time_backend(backend_name, [(context, PREFILL_TOKENS)])
                rows.append({"backend": backend_name, **prefill_row(peaks, context, seconds)})
        except Exception as error:  # e.g. the csrc extension did not build: go on without it
            print(f"{backend_name} failed: {error!r}", flush=True)
            failed[backend_name] = repr(error)[:500]
        print(f"{backend_name} done at {time.perf_counter() - started:.0f} s", flush=True)
    for context in (1024, 8192):
        try:
            seconds = time_sdpa_prefill(context)
        except Exception as error:
            failed[f"sdpa-prefill-{context}"] = repr(error)[:500]
        else:
            rows.append({"backend": "sdpa-gathered", **prefill_row(peaks, context, seconds)})
            print(json.dumps(rows[-1]), flush=True)
    report = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "peaks": peaks,
        "results": rows,
        "failed": failed,
        "sweep": [],
        "seconds": round(time.perf_counter() - started, 1),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)

    def save(sweep_rows: list[dict[str, Any]]) -> None:  # after every row: a time cap keeps some
        report.update(sweep=sweep_rows, seconds=round(time.perf_counter() - started, 1))
        args.out.write_text(json.dumps(report, indent=2) + "\n")

    save([])
    if args.sweep:
        save(sweep(peaks, save))
    print(
        f"{'backend':8} {'kind':18} {'batch':>5} {'context':>7} {'us':>10} {'achieved':>14} "
        f"{'of peak':>8}"
    )
    for r in rows:
        achieved = f"{r['achieved']} {r['unit']}"
        print(
            f"{r['backend']:8} {r['kind']:18} {r['batch']:>5} {r['context']:>7} {r['us']:>10} "
            f"{achieved:>14} {r['of_peak']:>8}"
        )


if __name__ == "__main__":
    main()
