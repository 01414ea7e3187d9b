"""This host's matmul peak, and the compute floor of the offline shared-prefix workload.

Peak: GFLOP/s of `torch.mm` in float32 and, where the host computes it natively (platform.py),
bfloat16, on a large square product and on the default model's own GEMM shapes (a 2,048-token
prefill chunk and a 64-sequence decode step through the attention and MLP projections and the
LM head, and the QKV and down projections of a 1,056-token step); the best of --repeats runs
each.
On the model's shapes also `F.linear` over a row-major weight (an nn.Linear) against the
engine's `PackedLinear` (weights reordered once for oneDNN, model/packed.py).

Decode step: every product of one decode step in order, each layer's weights its own (as in
the engine, so they stream from memory rather than sit in cache as they do when one product
is timed alone): milliseconds per step, GB/s of weights read and GFLOP/s, for 1, 8 and 64
sequences. At small batches a step is bound by reading the weights, not by the FLOPs; what
reading memory alone reaches (a sum over 512 MB, more than any cache) is reported beside it.
Where the CPU has AMX-BF16, the bf16 step is timed both ways, oneDNN's products and our tile
kernel's (`decode_step_tiles`, the engine's path for up to 128 rows), at 1 to 256 rows; and
the float32 step likewise, oneDNN's products against our vector kernel in each build of the
f32 library the CPU runs (`decode_step_vectors`; the engine's path for up to
`VECTOR_MAX_ROWS` rows, blockserve/kernels/cpu.py); the model's shapes in float32 are also timed the
engine's way, our kernel where it takes them (`linear_vs_packed_gflops`, "vectors"), and the
floor's peak is the fastest of `torch.mm`, the prepacked linear and that. `--decode-only`
times the comparison of --dtype alone (with `ONEDNN_MAX_CPU_ISA=AVX2` in the environment,
oneDNN's float32 side is what an AVX2 host runs).
In --dtype, each projection of a layer through `PackedLinear` at prefill-chunk row counts
(`packed_gflops_by_rows`, 160 to 2,048 rows).

Floor: the FLOPs of bench_offline.py's shared-prefix workload (64 × (1,024 shared + 32 own)
prompt tokens → 32 output tokens, prefix caching on, so the shared prefix is computed once):
linear layers for every computed token, the LM head for every sampled one, and attention
(QK^T and PV) at each token's context; divided by the peak (the fastest product measured,
either way), that is the least time the work could take on this host. A second floor, the
roofline one, also counts what the decode steps must read (every weight and the KV they
attend to, each step) at the measured read speed, taking for each step the slower of its
reads and its FLOPs. With --wall S (a measured run of that workload) it reports the run as a
fraction of both.

    .venv/bin/python benchmarks/bench_matmul.py [--wall 17.7 --dtype float32] [--decode-only]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from report import emit

from blockserve.config import default_cache_dir
from blockserve.kernels import CpuKernels
from blockserve.kernels import build as cpu_build
from blockserve.model.arch import LlamaArchConfig
from blockserve.model.loader import resolve_model_dir
from blockserve.model.packed import PackedLinear
from blockserve.model.weight_copies import pack_for_tiles, pack_for_vectors, use_kernels
from blockserve.platform import probe_host

PREFIX, SUFFIX, OUTPUT, REQUESTS = 1024, 32, 32, 64


def gflops(
    m: int, k: int, n: int, dtype: torch.dtype, repeats: int, how: str = "mm",
    kernels: CpuKernels | None = None,
) -> float:  # fmt: skip
    """Best-of-`repeats` GFLOP/s of an [m, k] × [k, n] product: `torch.mm`, `F.linear` over a
    row-major [n, k] weight (what an nn.Linear does), the model's `PackedLinear` over oneDNN's
    layout ("packed"), or with its copy for our float32 vector kernel too ("vectors": the
    engine's path, our kernel for up to `VECTOR_MAX_ROWS` rows, oneDNN's past them)."""
    a = torch.randn(m, k).to(dtype)
    b = torch.randn(k, n).to(dtype)
    linear = torch.nn.Linear(k, n, bias=False).to(dtype)
    layer = PackedLinear(linear) if how in ("packed", "vectors") else linear
    if how == "vectors":
        isa = cpu_build.target_for(torch.float32).isa
        assert kernels is not None
        ops = kernels.loader.load(default_cache_dir(), torch.float32, isa)
        pack_for_vectors(torch.nn.ModuleList([layer]), ops, isa)
        use_kernels(layer, kernels)

    def call() -> torch.Tensor:
        return torch.mm(a, b) if how == "mm" else layer(a)

    with torch.no_grad():
        call()  # warm-up (and oneDNN's first-call set-up)
        best = float("inf")
        for _ in range(repeats):
            started = time.perf_counter()
            call()
            best = min(best, time.perf_counter() - started)
    return 2 * m * k * n / best / 1e9


def model_shapes(arch: LlamaArchConfig) -> dict[str, tuple[int, int, int]]:
    hidden, inter = arch.hidden_size, arch.intermediate_size
    qkv = (arch.num_heads + 2 * arch.num_kv_heads) * arch.head_dim
    return {
        "prefill qkv (2048 tokens)": (2048, hidden, qkv),
        "prefill gate+up (2048 tokens)": (2048, hidden, 2 * inter),
        "prefill down (2048 tokens)": (2048, inter, hidden),
        # the shared-prefix workload's second step: 1,024 prompt tokens and 32 decodes
        "prefill qkv (1056 tokens)": (1056, hidden, qkv),
        "prefill down (1056 tokens)": (1056, inter, hidden),
        "decode gate+up (64 seqs)": (64, hidden, 2 * inter),
        "lm head (64 seqs)": (64, hidden, arch.vocab_size),
    }


SWEEP_ROWS = (160, 256, 384, 512, 544, 768, 1024, 1056, 1280, 1536, 1792, 2048)


def packed_by_rows(
    arch: LlamaArchConfig, dtype: torch.dtype, repeats: int
) -> dict[str, dict[int, float]]:
    """GFLOP/s of each projection of a layer through `PackedLinear` (oneDNN over the prepacked
    weight) at prefill-chunk row counts: where oneDNN's split of the work leaves a core idle,
    a row count's rate falls to about half its neighbours'."""
    hidden, inter = arch.hidden_size, arch.intermediate_size
    qkv = (arch.num_heads + 2 * arch.num_kv_heads) * arch.head_dim
    projections = {
        "qkv": (hidden, qkv),
        "o": (arch.num_heads * arch.head_dim, hidden),
        "gate+up": (hidden, 2 * inter),
        "down": (inter, hidden),
    }
    return {
        name: {rows: round(gflops(rows, k, n, dtype, repeats, "packed"), 1) for rows in SWEEP_ROWS}
        for name, (k, n) in projections.items()
    }


def decode_step(
    arch: LlamaArchConfig,
    dtype: torch.dtype,
    rows: tuple[int, ...],
    repeats: int,
    tile_ops: Any = None,  # our loaded bf16 operators: time our tile kernel, not oneDNN
    vector_isa: str | None = None,  # the f32 build loaded: time our vector kernel, not oneDNN
    kernels: CpuKernels | None = None,  # what loads and hands out those two
) -> dict[str, dict[str, float]]:
    """Median ms of one decode step's products over distinct weights; GB/s of weights read."""
    hidden, inter = arch.hidden_size, arch.intermediate_size
    q_width = arch.num_heads * arch.head_dim
    qkv = q_width + 2 * arch.num_kv_heads * arch.head_dim
    layer = ((hidden, qkv), (q_width, hidden), (hidden, 2 * inter), (inter, hidden))
    shapes = [shape for _ in range(arch.num_layers) for shape in layer]
    shapes.append((hidden, arch.vocab_size))  # the LM head
    linears = [PackedLinear(torch.nn.Linear(k, n, bias=False).to(dtype)) for k, n in shapes]
    weight_bytes = sum(k * n for k, n in shapes) * torch.finfo(dtype).bits // 8
    if tile_ops is not None:
        pack_for_tiles(torch.nn.ModuleList(linears), tile_ops)
    if vector_isa is not None:
        assert kernels is not None
        ops = kernels.loader.load(default_cache_dir(), torch.float32, vector_isa)
        pack_for_vectors(torch.nn.ModuleList(linears), ops, vector_isa)
    if kernels is not None:
        use_kernels(torch.nn.ModuleList(linears), kernels)
    results = {}
    for m in rows:
        inputs = [torch.randn(m, k).to(dtype) for k, _ in shapes]
        times = []
        with torch.no_grad():
            for _ in range(repeats + 1):  # the first is oneDNN's set-up
                started = time.perf_counter()
                for linear, x in zip(linears, inputs, strict=True):
                    linear(x)
                times.append(time.perf_counter() - started)
        seconds = statistics.median(times[1:])
        results[str(m)] = {
            "ms": round(seconds * 1e3, 2),
            "weight_gb_per_s": round(weight_bytes / seconds / 1e9, 1),
            "gflops": round(2 * m * sum(k * n for k, n in shapes) / seconds / 1e9, 1),
        }
    return results


DECODE_ROWS = (1, 8, 16, 32, 64, 128, 256)


def decode_tiles(arch: LlamaArchConfig, repeats: int, kernels: CpuKernels) -> dict[str, Any] | None:
    """A bf16 decode step's products, oneDNN's and our tile kernel's: None without AMX."""
    if not cpu_build.can_build(torch.bfloat16):
        return None
    ops = kernels.loader.load(default_cache_dir(), torch.bfloat16)
    if ops is None or not ops.has_amx():
        return None
    kernels.use_amx(False)
    tiles = {"onednn": decode_step(arch, torch.bfloat16, DECODE_ROWS, repeats)}
    kernels.use_amx(True)
    tiles["tiles"] = decode_step(arch, torch.bfloat16, DECODE_ROWS, repeats, ops, None, kernels)
    print("decode step, oneDNN vs tiles", tiles, flush=True)
    return tiles


def decode_vectors(
    arch: LlamaArchConfig, repeats: int, kernels: CpuKernels
) -> dict[str, Any] | None:
    """A float32 decode step's products, oneDNN's and our vector kernel's in each build of
    the f32 library the CPU runs: None where there is none."""
    if not cpu_build.can_build(torch.float32):
        return None
    vectors = {"onednn": decode_step(arch, torch.float32, DECODE_ROWS, repeats)}
    limit = kernels.switches.vector_max_rows
    kernels.switches.vector_max_rows = max(DECODE_ROWS)  # past the engine's limit too
    try:
        for build in reversed(cpu_build.runnable(torch.float32)):  # the widest left loaded
            vectors[build.isa] = decode_step(
                arch, torch.float32, DECODE_ROWS, repeats, vector_isa=build.isa, kernels=kernels
            )
    finally:
        kernels.switches.vector_max_rows = limit
    print("decode step, oneDNN vs vectors", vectors, flush=True)
    return vectors


def memory_read_gb_per_s(repeats: int) -> float:
    """GB/s of one pass over 512 MB (a sum: a read and nothing else), the best of `repeats`."""
    data = torch.ones(128 * 1024 * 1024)
    best = float("inf")
    for _ in range(repeats + 1):
        started = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - started)
    return round(data.numel() * data.element_size() / best / 1e9, 1)


def workload_gflop(arch: LlamaArchConfig) -> dict[str, float]:
    """The shared-prefix workload's FLOPs, in GFLOP, by kind."""
    hidden, inter, layers = arch.hidden_size, arch.intermediate_size, arch.num_layers
    q_width = arch.num_heads * arch.head_dim
    kv_width = arch.num_kv_heads * arch.head_dim
    per_token_linear = 2 * layers * (hidden * (q_width + 2 * kv_width) + q_width * hidden)
    per_token_linear += 2 * layers * 3 * hidden * inter
    # Tokens whose KV is computed, with the context each attends to (itself included).
    contexts = list(range(1, PREFIX + 1))  # the shared prefix, once
    for _ in range(REQUESTS):
        contexts += range(PREFIX + 1, PREFIX + SUFFIX + 1)  # its own suffix
        contexts += range(PREFIX + SUFFIX + 1, PREFIX + SUFFIX + OUTPUT)  # 31 decode steps
    attention = sum(4 * layers * q_width * c for c in contexts)  # QK^T and PV
    lm_head = 2 * hidden * arch.vocab_size * REQUESTS * OUTPUT
    return {
        "computed_tokens": len(contexts),
        "linear": per_token_linear * len(contexts) / 1e9,
        "attention": attention / 1e9,
        "lm_head": lm_head / 1e9,
        "total": (per_token_linear * len(contexts) + attention + lm_head) / 1e9,
    }


def roofline_floor_s(
    arch: LlamaArchConfig, element_bytes: int, peak_gflops: float, read_gb_per_s: float
) -> float:
    """The shared-prefix workload's least time when each step is bound by whichever is slower,
    its FLOPs at `peak_gflops` or its reads at `read_gb_per_s`: the prompt tokens as compute
    (the first token of each request sampled there), each of the 31 decode steps as the larger
    of its FLOPs and its reads (every weight once, the shared prefix's K and V once, each
    sequence's own)."""
    hidden, inter, layers = arch.hidden_size, arch.intermediate_size, arch.num_layers
    q_width = arch.num_heads * arch.head_dim
    kv_width = arch.num_kv_heads * arch.head_dim
    layer_params = hidden * (q_width + 2 * kv_width) + q_width * hidden + 3 * hidden * inter
    weights = layers * layer_params + hidden * arch.vocab_size
    prompt = list(range(1, PREFIX + 1)) + REQUESTS * list(range(PREFIX + 1, PREFIX + SUFFIX + 1))
    prompt_flop = sum(2 * layers * layer_params + 4 * layers * q_width * c for c in prompt)
    prompt_flop += 2 * hidden * arch.vocab_size * REQUESTS
    seconds = prompt_flop / (peak_gflops * 1e9)
    for step in range(1, OUTPUT):
        context = PREFIX + SUFFIX + step
        flop = REQUESTS * (2 * weights + 4 * layers * q_width * context)
        kv = (PREFIX + REQUESTS * (SUFFIX + step)) * layers * 2 * kv_width
        read = (weights + kv) * element_bytes
        seconds += max(flop / (peak_gflops * 1e9), read / (read_gb_per_s * 1e9))
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--wall", type=float, help="a measured shared-prefix run, seconds")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/matmul/matmul.json"))
    parser.add_argument("--decode-only", action="store_true")
    args = parser.parse_args()
    # bf16 where the host computes it natively; elsewhere its generic path would take minutes
    # to say it is ~100x slower (platform.py), and oneDNN cannot prepack it.
    native = probe_host(torch.device("cpu")).native_bf16
    if args.dtype == "bfloat16" and not native:
        parser.error("--dtype bfloat16: this host has no native bf16 (platform.py)")
    config = json.loads((resolve_model_dir(None) / "config.json").read_text())
    arch = LlamaArchConfig.from_hf(config)
    kernels = CpuKernels()
    if args.decode_only:
        decodes = (
            {"decode_step_tiles": decode_tiles(arch, args.repeats, kernels)}
            if args.dtype == "bfloat16"
            else {"decode_step_vectors": decode_vectors(arch, args.repeats, kernels)}
        )
        emit({"torch": torch.__version__, **decodes}, args.out)
        return
    peaks: dict[str, dict[str, float]] = {}
    linears: dict[str, dict[str, dict[str, float]]] = {}
    decode: dict[str, dict[str, dict[str, float]]] = {}
    dtypes = [("float32", torch.float32)] + ([("bfloat16", torch.bfloat16)] if native else [])
    for name, dtype in dtypes:
        shapes = {"square 2048": (2048, 2048, 2048), **model_shapes(arch)}
        peaks[name] = {
            label: round(gflops(*shape, dtype, args.repeats), 1) for label, shape in shapes.items()
        }
        ways = ("linear", "packed")
        if dtype == torch.float32 and cpu_build.can_build(torch.float32):
            ways += ("vectors",)
        linears[name] = {
            label: {
                how: round(gflops(*shape, dtype, args.repeats, how, kernels), 1) for how in ways
            }
            for label, shape in model_shapes(arch).items()
        }
        kernels.use_amx(False)  # oneDNN's products
        decode[name] = decode_step(arch, dtype, (1, 8, 64), args.repeats)
        print(name, peaks[name], linears[name], decode[name], flush=True)
    tiles = decode_tiles(arch, args.repeats, kernels)
    vectors = decode_vectors(arch, args.repeats, kernels)
    by_rows = packed_by_rows(arch, getattr(torch, args.dtype), args.repeats)
    print("packed products by rows", by_rows, flush=True)
    work = workload_gflop(arch)
    # The fastest product measured any way: torch.mm, the prepacked linear or our kernel.
    packed_peaks = (v[how] for v in linears[args.dtype].values() for how in v if how != "linear")
    peak = max(*peaks[args.dtype].values(), *packed_peaks)
    floor = work["total"] / peak
    read_speed = memory_read_gb_per_s(args.repeats)
    element_bytes = torch.finfo(getattr(torch, args.dtype)).bits // 8
    roofline = roofline_floor_s(arch, element_bytes, peak, read_speed)
    results: dict[str, Any] = {
        "torch": torch.__version__,
        "gflops": peaks,
        "linear_vs_packed_gflops": linears,
        "decode_step": decode,
        "decode_step_tiles": tiles,
        "decode_step_vectors": vectors,
        "packed_gflops_by_rows": by_rows,
        "memory_read_gb_per_s": read_speed,
        "workload_gflop": {k: round(v, 1) for k, v in work.items()},
        "floor_dtype": args.dtype,
        "floor_peak_gflops": peak,
        "floor_s": round(floor, 2),
        "roofline_floor_s": round(roofline, 2),
    }
    if args.wall is not None:
        results["wall_s"] = args.wall
        results["fraction_of_floor"] = round(floor / args.wall, 3)
        results["fraction_of_roofline_floor"] = round(roofline / args.wall, 3)
    emit(results, args.out)


if __name__ == "__main__":
    main()
