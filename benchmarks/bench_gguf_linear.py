"""One decode step's products at the default model's shapes (SmolLM2-135M: 30 layers of qkv
960×576, o 576×576, gate/up 3,072×576, down 576×1,536, Q4_1; the LM head 49,152×576, Q8_0),
each layer its own weight so that the step reads them from memory as the engine does: our
GGUF kernel over the blocks (`gguf_linear`, --quantization gguf) against our AMX tile kernel
over bf16 (`tile_linear`, the dense path), at 1 to 16 rows. Seeded random weights quantized
by the gguf package; the median of 3 rounds of 10 steps, the two kernels taking turns.
`--kernels tile` times the tile kernel alone, at any row count up to 128 (a mixed step's
prefill and decode rows).

    .venv/bin/python benchmarks/bench_gguf_linear.py [--rows 1 2 4 8 16] [--kernels gguf tile]
        [--out FILE]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize
from report import emit

from blockserve.config import default_cache_dir
from blockserve.kernels.loader import KernelLoader

LAYERS = 30
LAYER_SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))  # (out, in), Q4_1
HEAD = (49152, 576)  # Q8_0


def weights(ops: Any) -> list[tuple[int, int, torch.Tensor, torch.Tensor]]:
    """Every product of a step: (in features, GGML type, GGUF blocks packed, bf16 tile copy)."""
    rng = np.random.default_rng(0)
    shapes = [(*shape, GGMLQuantizationType.Q4_1) for shape in LAYER_SHAPES] * LAYERS
    made = []
    for n, k, qtype in [*shapes, (*HEAD, GGMLQuantizationType.Q8_0)]:
        w = (rng.standard_normal((n, k)) * 0.02).astype(np.float32)
        blocks = ops.gguf_pack(torch.from_numpy(quantize(w, qtype)), int(qtype))
        made.append((k, int(qtype), blocks, ops.tile_pack(torch.from_numpy(w).bfloat16())))
    return made


def step_ms(ops: Any, made: list, rows: int, kernels: list[str]) -> dict[str, float]:
    xs = {k: torch.randn(rows, k).bfloat16() for k in {k for k, *_ in made}}
    runs = {
        "gguf": lambda: [ops.gguf_linear(xs[k], b, q, None) for k, q, b, _ in made],
        "tile": lambda: [ops.tile_linear(xs[k], t, None) for k, _, _, t in made],
    }
    runs = {name: run for name, run in runs.items() if name in kernels}
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(3):
        for name, run in runs.items():
            run()
            started = time.perf_counter()
            for _ in range(10):
                run()
            times[name].append((time.perf_counter() - started) / 10 * 1e3)
    return {f"{name}_ms": round(statistics.median(t), 3) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", nargs="+", type=int, default=[1, 2, 4, 8, 16])
    parser.add_argument("--kernels", nargs="+", choices=["gguf", "tile"], default=["gguf", "tile"])
    parser.add_argument(
        "--out", type=Path, default=Path("benchmarks/results/gguf_linear/gguf_linear.json")
    )
    args = parser.parse_args()
    ops = KernelLoader().load(default_cache_dir(), torch.bfloat16)
    if ops is None or not ops.has_amx():
        raise SystemExit("needs our bf16 kernels on a CPU with AMX-BF16")
    made = weights(ops)
    results: dict[str, Any] = {
        "kernels": args.kernels,
        "gguf_bytes": sum(b.numel() for _, _, b, _ in made),
        "bf16_bytes": sum(t.numel() * 2 for *_, t in made),
        "rows": {},
    }
    for rows in args.rows:
        results["rows"][str(rows)] = step_ms(ops, made, rows, args.kernels)
        print(rows, results["rows"][str(rows)], flush=True)
    emit(results, args.out)


if __name__ == "__main__":
    main()
