"""Where widening bf16 products to float32 pays, where half precision does, and from how many
rows: this core's bf16 dot product and float32 FMA rates (our library's `dot_rates`), then one
step's products over every linear layer of the loaded model (the engine's `PackedLinear`s, each
weight its own), timed in the same process taking turns: our vector kernel over the bf16
panels, oneDNN's over the float32 wide copies, oneDNN's bf16 (over weights reordered here: the
engine drops its own beside the two copies), and where the CPU has AVX512-FP16 our
half-precision kernel (the engine's half copies; the wide ones are then made here) (ms a step,
the median of --repeats after one warm-up), at 16 to 256 rows. Where widening does not pay
here, the model has no copies and only the rates are reported.

    .venv/bin/python benchmarks/bench_wide_products.py [--model DIR] [--out FILE]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import emit

ROWS = (16, 32, 48, 64, 96, 128, 160, 192, 256)


def step_ms(
    layers: list[Any], onednn: list[Any], rows: int, repeats: int, kernels: Any
) -> dict[str, float]:
    """One step's products of `rows` rows on each path, the median ms of `repeats` turns
    (`onednn`: each layer's bf16 weight reordered for oneDNN)."""
    import torch

    from blockserve.model.packed import _packed_linear

    xs = [torch.randn(rows, layer.in_features).bfloat16() for layer in layers]
    never = 1 << 30
    paths = {  # (wide_min_rows, half_min_rows), or None: oneDNN's bf16
        "vectors": (never, never),
        "wide": (1, never),
        "onednn_bf16": None,
    }
    if all(layer.halves is not None for layer in layers):
        paths["halves"] = (never, 1)
    times: dict[str, list[float]] = {name: [] for name in paths}
    switches = kernels.switches
    saved = switches.wide_min_rows, switches.half_min_rows
    try:
        with torch.inference_mode():
            for _ in range(repeats + 1):
                for name, least in paths.items():
                    if least is not None:
                        switches.wide_min_rows, switches.half_min_rows = least
                    started = time.perf_counter()
                    for layer, weight, x in zip(layers, onednn, xs, strict=True):
                        if least is None:
                            _packed_linear(x, weight, layer.bias)
                        else:
                            layer(x)
                    times[name].append(time.perf_counter() - started)
    finally:
        switches.wide_min_rows, switches.half_min_rows = saved
    return {name: round(statistics.median(t[1:]) * 1e3, 1) for name, t in times.items()}


def main() -> None:
    import torch

    from blockserve import LLM
    from blockserve.model.packed import PackedLinear
    from blockserve.model.weight_copies import pack_wide

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="default: the embedded model")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    llm = LLM(args.model, dtype="bfloat16")
    kernels = llm.engine.core.runner.kernels
    kernels.loader.wait()
    ops = kernels.loader.ops(torch.bfloat16)
    bf16, f32 = ops.dot_rates() if ops is not None else (None, None)
    model = llm.engine.core.runner.model
    layers = [m for m in model.modules() if isinstance(m, PackedLinear)]
    halved = all(m.halves is not None for m in layers)
    if halved:
        pack_wide(model)
    widened = all(m.wide is not None for m in layers)
    by_rows = {}
    if widened:
        onednn = [torch.ops.mkldnn._reorder_linear_weight(m.dense_weight(), None) for m in layers]
        by_rows = {rows: step_ms(layers, onednn, rows, args.repeats, kernels) for rows in ROWS}
    emit(
        {
            "benchmark": "wide_products",
            "model": args.model or "embedded SmolLM2-135M-Instruct",
            "dot_rates_gflops_a_core": {"bf16_dot": bf16, "f32_fma": f32},
            "layers": len(layers),
            "widened": widened,
            "halved": halved,
            "wide_min_rows": kernels.switches.wide_min_rows,
            "half_min_rows": kernels.switches.half_min_rows,
            "step_ms_by_rows": by_rows,
        },
        args.out,
    )


if __name__ == "__main__":
    main()
