"""CPU attention on the shapes of the offline workloads: what torch's fused kernel reaches, and
the alternatives measured against it (speed and error against a float64 reference).

The default model's attention: 9 query heads over 3 KV heads, head dimension 64. Cases:
  decode-common   every decode of the shared-prefix run against the shared 1,024 keys, each KV
                  head's 3 query heads × 64 sequences folded into 192 rows (no mask)
  decode-own      the same decodes against each sequence's own last blocks (64 keys, masked)
  prefill-common  64 × 32 new tokens against the shared 1,024 keys: 6,144 rows per KV head
  causal-544, causal-1056   one fresh prefill (no-sharing run; the shared prefix's first request)
Variants:
  fused           torch's CPU flash attention
  ours            our kernel (attention/cpu_dense_bf16.cpp), bf16 where the CPU has AVX512-BF16
  explicit        the same in separate ops: float32 scores, softmax, product
  compiled        `explicit` through torch.compile (inductor fuses the softmax into C++ loops)
  bf16-scores     decode-common + decode-own as one softmax over bfloat16 products (no LSE
                  merge): the products' outputs are rounded to bf16, which is the error to see
  q-chunks-128    a causal prefill as 128-query chunks: each chunk's earlier keys unmasked
                  (query heads folded into rows) and its own block causal, merged by LSE
GFLOP/s count QK^T and PV of the attended (unmasked) pairs; medians of --repeats calls.

    .venv/bin/python benchmarks/bench_attention_cpu.py [--dtype bfloat16 float32] [--out FILE]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from report import emit

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from blockserve.attention import cpu_kernels
from blockserve.attention.shared_prefix import attend, attend_heads, merge
from blockserve.model.loader import default_cache_dir

HEADS, KV_HEADS, DIM = 9, 3, 64
GROUP = HEADS // KV_HEADS
DECODES, COMMON, OWN = 64, 1024, 64

Tensors = tuple[torch.Tensor, ...]
# torch's fused CPU attention, in the variant that also returns the log-sum-exp
FUSED = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def median_seconds(fn: Callable[..., object], inputs: Tensors, repeats: int) -> float:
    for _ in range(3):
        fn(*inputs)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn(*inputs)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def dense_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any = None):
    scores = q.double() @ k.double().transpose(-1, -2) * DIM**-0.5
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return scores.softmax(-1) @ v.double()


def explicit(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    out, _ = attend(q, k, v)
    return out


compiled = torch.compile(explicit, dynamic=False)


def bf16_scores(q, common_k, common_v, own_k, own_v, own_mask) -> torch.Tensor:
    """decode-common and decode-own in one softmax, products in the input dtype."""
    q_rows = q.permute(1, 0, 2, 3).reshape(KV_HEADS, DECODES * GROUP, DIM) * DIM**-0.5
    common = q_rows @ common_k[0].transpose(-1, -2)  # [kv, rows, common]
    own = (q * DIM**-0.5) @ own_k.transpose(-1, -2)  # [decodes, kv, group, own]
    own = own.masked_fill(~own_mask, float("-inf")).permute(1, 0, 2, 3)
    probs = torch.cat([common, own.reshape(KV_HEADS, DECODES * GROUP, -1)], -1).softmax(-1)
    out = probs[..., :COMMON] @ common_v[0]
    own_probs = probs[..., COMMON:].reshape(KV_HEADS, DECODES, GROUP, -1).permute(1, 0, 2, 3)
    return out.view(KV_HEADS, DECODES, GROUP, DIM).permute(1, 0, 2, 3) + own_probs @ own_v


def two_part_reference(q, common_k, common_v, own_k, own_v, own_mask) -> torch.Tensor:
    keys = torch.cat([common_k.expand(DECODES, -1, -1, -1), own_k], 2)
    values = torch.cat([common_v.expand(DECODES, -1, -1, -1), own_v], 2)
    always = torch.ones(DECODES, 1, 1, COMMON, dtype=torch.bool)
    return dense_reference(q, keys, values, torch.cat([always, own_mask], -1))


def q_chunks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunk: int = 128):
    """Causal attention of [1, heads, n, dim] queries as chunks (see the module docstring)."""
    n = q.shape[2]
    out = torch.empty(1, HEADS, n, DIM)
    for start in range(0, n, chunk):
        end = min(n, start + chunk)
        own, own_lse = FUSED(  # the chunk's own block, causal (GQA handled by the kernel)
            q[:, :, start:end], k[:, :, start:end], v[:, :, start:end], is_causal=True
        )
        if start == 0:
            out[:, :, :end] = own
            continue
        rows = q[0, :, start:end].reshape(KV_HEADS, GROUP * (end - start), DIM)[None]
        earlier, lse = attend_heads(rows, k[:, :, :start], v[:, :, :start])
        shape = (1, HEADS, end - start)
        out[:, :, start:end] = merge(
            earlier.reshape(*shape, DIM), lse.reshape(shape), own.float(), own_lse
        )
    return out


def cases(dtype: torch.dtype) -> dict[str, tuple[float, Tensors, dict[str, Callable]]]:
    """name → (attended pairs, inputs, variants); every variant returns the output."""
    gen = torch.Generator().manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype)

    dense: dict[str, Callable] = {
        "fused": lambda q, k, v: FUSED(q, k, v)[0],
        "explicit": explicit,
        "compiled": compiled,
    }
    kernel = cpu_kernels.load(default_cache_dir()) if cpu_kernels.supported() else None
    if kernel is not None and dtype == torch.bfloat16:
        dense["ours"] = lambda q, k, v: kernel(q[0], k[0], v[0], DIM**-0.5)[0][None]
    q = randn(DECODES, KV_HEADS, GROUP, DIM)
    common_k, common_v = randn(1, KV_HEADS, COMMON, DIM), randn(1, KV_HEADS, COMMON, DIM)
    own_k, own_v = randn(DECODES, KV_HEADS, OWN, DIM), randn(DECODES, KV_HEADS, OWN, DIM)
    lengths = torch.randint(1, OWN + 1, (DECODES, 1, 1, 1), generator=gen)
    own_mask = torch.arange(OWN)[None, None, None, :] < lengths
    folded = q.permute(1, 0, 2, 3).reshape(1, KV_HEADS, DECODES * GROUP, DIM)
    rows = DECODES * GROUP
    out: dict[str, tuple[float, Tensors, dict[str, Callable]]] = {
        "decode-common": (rows * COMMON * KV_HEADS, (folded, common_k, common_v), dense),
        "decode-own": (
            int(lengths.sum()) * HEADS,
            (q, own_k, own_v, own_mask),
            {
                "fused": lambda q, k, v, m: attend_heads(q, k, v, m)[0],
                "explicit": lambda q, k, v, m: attend(q, k, v, m)[0],
            },
        ),
        "decode-common+own": (
            rows * COMMON * KV_HEADS + int(lengths.sum()) * HEADS,
            (q, common_k, common_v, own_k, own_v, own_mask),
            {"bf16-scores": bf16_scores},
        ),
        "prefill-common": (
            32 * rows * COMMON * KV_HEADS,
            (randn(1, KV_HEADS, 32 * rows, DIM), common_k, common_v),
            dense,
        ),
    }
    for n in (544, 1056):
        causal_inputs = (
            randn(1, HEADS, n, DIM),
            randn(1, KV_HEADS, n, DIM),
            randn(1, KV_HEADS, n, DIM),
        )
        out[f"causal-{n}"] = (
            n * (n + 1) // 2 * HEADS,
            causal_inputs,
            {
                "fused": lambda q, k, v: F.scaled_dot_product_attention(
                    q, k, v, is_causal=True, enable_gqa=True
                ),
                "q-chunks-128": q_chunks,
            },
        )
    return out


def reference(name: str, inputs: Tensors) -> torch.Tensor:
    if name == "decode-common+own":
        return two_part_reference(*inputs)
    if name == "decode-own":
        return dense_reference(*inputs)
    if name.startswith("causal"):
        q, k, v = inputs
        n = q.shape[2]
        k, v = k.repeat_interleave(GROUP, 1), v.repeat_interleave(GROUP, 1)
        return dense_reference(q, k, v, torch.ones(n, n, dtype=torch.bool).tril())
    return dense_reference(*inputs)


def run(dtype: torch.dtype, repeats: int) -> list[dict[str, Any]]:
    rows = []
    for name, (pairs, inputs, variants) in cases(dtype).items():
        expected = reference(name, inputs)
        for variant, fn in variants.items():
            seconds = median_seconds(fn, inputs, repeats)
            error = (fn(*inputs).double().reshape(expected.shape) - expected).abs().max()
            rows.append(
                {
                    "case": name,
                    "variant": variant,
                    "ms": round(seconds * 1e3, 3),
                    "gflop_per_s": round(4 * DIM * pairs / seconds / 1e9, 1),
                    "max_abs_error": float(f"{error.item():.3g}"),
                }
            )
            print(rows[-1], flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", nargs="+", default=["bfloat16", "float32"])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    results = {name: run(getattr(torch, name), args.repeats) for name in args.dtype}
    emit({"benchmark": "attention_cpu", "results": results}, args.out)


if __name__ == "__main__":
    main()
