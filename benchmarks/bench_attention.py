"""Attention kernels on a CUDA device: decode bandwidth and prefill-on-prefix FLOP rate.

Decode: batch 1 / 64 / 256 sequences, context 1k / 8k, one query each; achieved bandwidth =
K and V bytes read / kernel time, against the device's measured copy bandwidth.
Prefill-on-prefix: 512 new tokens on top of a cached 1k / 8k context; achieved FLOP/s (causal
QK^T and PV) against the device's measured bf16 matmul rate. bf16, 32 query heads, 8 KV heads,
head_dim 128, block size 16.

    .venv/bin/python benchmarks/bench_attention.py [--backends triton cuda torch] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from blockserve.attention.selector import get_attention_backend
from tests.attention.cases import make_case  # the same random paged cases as the tests

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128


def cuda_time(fn, repeats: int = 20) -> float:  # type: ignore[no-untyped-def]
    """Median seconds of `fn` on the device (CUDA events)."""
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
    size = 1 << 28  # 512 MiB of bf16
    src = torch.empty(size, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    copy_s = cuda_time(lambda: dst.copy_(src))
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    matmul_s = cuda_time(lambda: a @ a)
    return {
        "copy_gb_per_s": 2 * src.numel() * 2 / copy_s / 1e9,
        "bf16_matmul_tflops": 2 * 8192**3 / matmul_s / 1e12,
    }


def bench(backend_name: str, specs: list[tuple[int, int]]) -> float:
    case = make_case(specs, HEADS, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16).to("cuda")
    backend = get_attention_backend(backend_name, "cuda")
    plan = backend.prepare(case.metadata)
    return cuda_time(lambda: backend.forward(case.query, case.key, case.value, case.kv_cache, plan))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backends", nargs="+", default=["triton", "cuda", "torch"])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/attention.json"))
    args = parser.parse_args()
    peaks = device_peaks()
    rows = []
    for backend_name in args.backends:
        for context in (1024, 8192):
            for batch in (1, 64, 256):
                seconds = bench(backend_name, [(context, 1)] * batch)
                bytes_read = batch * (context + 1) * KV_HEADS * HEAD_DIM * 2 * 2
                bandwidth = bytes_read / seconds / 1e9
                rows.append(
                    {
                        "backend": backend_name,
                        "kind": "decode",
                        "batch": batch,
                        "context": context,
                        "us": round(seconds * 1e6, 1),
                        "gb_per_s": round(bandwidth, 1),
                        "fraction_of_copy": round(bandwidth / peaks["copy_gb_per_s"], 3),
                    }
                )
            seconds = bench(backend_name, [(context, 512)])
            flops = 4 * HEADS * HEAD_DIM * 512 * (context + 256)  # causal over the new tokens
            tflops = flops / seconds / 1e12
            rows.append(
                {
                    "backend": backend_name,
                    "kind": "prefill_on_prefix",
                    "batch": 1,
                    "context": context,
                    "us": round(seconds * 1e6, 1),
                    "tflops": round(tflops, 2),
                    "fraction_of_matmul": round(tflops / peaks["bf16_matmul_tflops"], 3),
                }
            )
    report = {"device": torch.cuda.get_device_name(), "peaks": peaks, "results": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report["peaks"]))
    print(
        f"{'backend':8} {'kind':18} {'batch':>5} {'context':>7} {'us':>10} "
        f"{'achieved':>10} {'of peak':>8}"
    )
    for r in rows:
        achieved = r.get("gb_per_s", r.get("tflops"))
        fraction = r.get("fraction_of_copy", r.get("fraction_of_matmul"))
        print(
            f"{r['backend']:8} {r['kind']:18} {r['batch']:>5} {r['context']:>7} {r['us']:>10} "
            f"{achieved:>10} {fraction:>8}"
        )


if __name__ == "__main__":
    main()
