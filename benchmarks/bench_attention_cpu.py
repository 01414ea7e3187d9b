"""CPU attention on the shapes of the offline workloads: what torch's fused kernel reaches, and
the alternatives measured against it (speed and error against a float64 reference).

The default model's attention: 9 query heads over 3 KV heads, head dimension 64. Cases:
  decode-common   every decode of the shared-prefix run against the shared 1,024 keys, each KV
                  head's 3 query heads × 64 sequences folded into 192 rows (no mask)
  decode-own      the same decodes against each sequence's own last blocks (64 keys, masked)
  decode-alone    64 decodes sharing nothing, each over its own 1,088 keys
  prefill-common  64 × 32 new tokens against the shared 1,024 keys: 6,144 rows per KV head
  causal-544, causal-1056   one fresh prefill (no-sharing run; the shared prefix's first request)
Variants:
  fused           torch's CPU flash attention
  ours            our kernel (csrc/cpu/attention.h): bf16 where the CPU has AVX512-BF16
                  (its products on AMX tiles where it has AMX-BF16), float32 where it has
                  AVX2; masked cases as per-row key counts, causal ones with query heads folded
  ours-vectors    on an AMX host, bf16 `ours` with the tiles switched out (`use_amx`)
  ours-wide, ours-paged-wide   where the engine widens bf16 products (`widening_pays`: no
                  AMX, float32 FMAs faster than vdpbf16ps), `ours` and `ours-paged` with the
                  widened policy switched in, as the engine runs them there
  explicit        the same in separate ops: float32 scores, softmax, product
  compiled        `explicit` through torch.compile (inductor fuses the softmax into C++ loops)
  batched-products  decode-alone as the backend computes it in bf16 (products in bf16)
  ours-paged      decode-own and decode-alone through our paged-decode kernel, the keys in a
                  paged cache of 16-token blocks in shuffled order (laid out before timing)
  gather+products decode-alone from that same cache as the torch backend computes it without
                  the kernel: blocks gathered into its workspace, then batched-products
  bf16-scores     decode-common + decode-own as one softmax over bfloat16 products (no LSE
                  merge): the products' outputs are rounded to bf16, which is the error to see
  q-chunks-128    a causal prefill as 128-query chunks: each chunk's earlier keys unmasked
                  (query heads folded into rows) and its own block causal, merged by LSE
GFLOP/s count QK^T and PV of the attended (unmasked) pairs; medians of --repeats calls.

    .venv/bin/python benchmarks/bench_attention_cpu.py [--dtype bfloat16 float32] [--out FILE]
"""

from __future__ import annotations

import argparse
import functools
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
from blockserve.attention.prefill import attend_causal
from blockserve.attention.shared_prefix import attend, merge
from blockserve.attention.torch_backend import DecodePlan, TorchAttentionBackend
from blockserve.config import default_cache_dir
from blockserve.kernels import CpuKernels
from blockserve.kernels import build as cpu_build
from blockserve.model.weight_copies import widening_pays

HEADS, KV_HEADS, DIM = 9, 3, 64
GROUP = HEADS // KV_HEADS
DECODES, COMMON, OWN = 64, 1024, 64
ALONE = 1088  # a decode's whole context when it shares no blocks

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


def additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A bool mask as the fused kernel takes it: 0 where seen, -inf elsewhere."""
    return torch.zeros(mask.shape, dtype=dtype).masked_fill(~mask, float("-inf"))


def batched_products(q, k, v, mask) -> torch.Tensor:
    """The backend's bf16 decodes without a shared prefix: products in bf16 (rounded scores)."""
    scores = (q @ k.transpose(-1, -2) * DIM**-0.5).masked_fill(~mask, float("-inf"))
    return scores.softmax(-1, dtype=torch.float32).to(q.dtype) @ v


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
        earlier, lse = FUSED(rows, k[:, :, :start], v[:, :, :start])
        shape = (1, HEADS, end - start)
        out[:, :, start:end] = merge(
            earlier.float().reshape(*shape, DIM), lse.reshape(shape), own.float(), own_lse
        )
    return out


def variant_sets(dtype: torch.dtype, seen: torch.Tensor) -> dict[str, dict[str, Callable]]:
    """The variants timed on each kind of case; `seen`: decode-own's per-row key counts."""

    def masked_fused(q, k, v, mask):
        return FUSED(q, k, v, attn_mask=additive(mask, q.dtype))[0]

    sets: dict[str, dict[str, Callable]] = {
        "dense": {"fused": lambda q, k, v: FUSED(q, k, v)[0], "explicit": explicit},
        "own": {"fused": masked_fused, "explicit": lambda q, k, v, m: attend(q, k, v, m)[0]},
        "alone": {"fused": masked_fused, "batched-products": batched_products},
        "causal": {
            "fused": lambda q, k, v: F.scaled_dot_product_attention(
                q, k, v, is_causal=True, enable_gqa=True
            ),
            "q-chunks-128": q_chunks,
        },
    }
    sets["dense"]["compiled"] = compiled
    if not cpu_build.can_build(dtype):
        return sets
    kernels = CpuKernels()
    builds = [target.isa for target in cpu_build.runnable(dtype)]
    for isa in reversed(builds):  # the widest last: it stays loaded, as in the engine
        ops = kernels.loader.load(default_cache_dir(), dtype, isa)
        if ops is None:
            return sets
        # "ours" is the build this host runs; a narrower one it can run too is "ours-<isa>".
        name = "ours" if isa == builds[0] else f"ours-{isa}"
        kernel, scale = ops.dense_attention, DIM**-0.5
        sets["dense"][name] = functools.partial(dense_ours, kernel, scale)
        sets["own"][name] = functools.partial(own_ours, kernel, scale, seen)
        sets["alone"][name] = functools.partial(alone_ours, kernel, scale)
        paged = paged_variant(ops.paged_decode)
        sets["own"][f"{name}-paged"] = paged
        sets["alone"][f"{name}-paged"] = paged
        sets["causal"][name] = functools.partial(causal_ours, kernel)
    sets["alone"]["gather+products"] = paged_variant(ops.paged_decode, through_backend=True)
    if kernels.use_amx(True):  # an AMX host: "ours" ran on the tiles
        for kind in ("dense", "own", "causal"):
            sets[kind]["ours-vectors"] = switched(sets[kind]["ours"], kernels.use_amx, False)
    if dtype == torch.bfloat16 and widening_pays(ops):
        for kind, name in (("dense", "ours"), ("own", "ours"), ("causal", "ours"),
                           ("own", "ours-paged"), ("alone", "ours-paged")):  # fmt: skip
            sets[kind][f"{name}-wide"] = switched(
                sets[kind][name], kernels.use_wide_attention, True
            )
    return sets


def dense_ours(kernel: Callable, scale: float, q, k, v) -> torch.Tensor:
    return kernel(q, k, v, None, scale)[0]


def own_ours(kernel: Callable, scale: float, seen: torch.Tensor, q, k, v, mask) -> torch.Tensor:
    return kernel(q, k, v, seen, scale)[0]


def alone_ours(kernel: Callable, scale: float, q, k, v, mask) -> torch.Tensor:
    return kernel(q, k, v, None, scale)[0]


def causal_ours(kernel: Callable, q, k, v) -> torch.Tensor:
    return attend_causal(kernel, *(x[0].transpose(0, 1) for x in (q, k, v))).transpose(0, 1)[None]


def switched(
    fn: Callable[..., torch.Tensor], switch: Callable[[bool], object], during: bool
) -> Callable[..., torch.Tensor]:
    """`fn` with one of our kernels' policy switches (`CpuKernels.use_amx`,
    `use_wide_attention`) set to `during` for each call, and back to `not during` after."""

    def run(*inputs: torch.Tensor) -> torch.Tensor:
        switch(during)
        try:
            return fn(*inputs)
        finally:
            switch(not during)

    return run


def paged_variant(kernel: Callable, through_backend: bool = False) -> Callable[..., torch.Tensor]:
    """Decodes through `paged_decode` (or, `through_backend`, the torch backend's decode path
    without it): q, k, v [decodes, kv_heads, n, dim] and a key mask [decodes, 1, 1, keys] that
    shows each decode a prefix of its keys. The paged cache is laid out once per input (in the
    engine the keys already lie there)."""
    laid_out: dict[tuple[int, int], Tensors] = {}
    backend = TorchAttentionBackend()  # none of our kernels: torch's gather and products

    def paged(q, k, v, mask) -> torch.Tensor:
        key = (k.data_ptr(), v.data_ptr())
        if key not in laid_out:
            laid_out[key] = paged_cache(k, v, mask)
        kv_cache, tables, lengths = laid_out[key]
        decodes, kv_heads, group, dim = q.shape
        queries = q.reshape(decodes, kv_heads * group, dim)
        if not through_backend:
            return kernel(queries, kv_cache[0], kv_cache[1], tables, lengths, dim**-0.5)[0]
        plan = DecodePlan(
            token_indices=torch.arange(decodes),
            common_block_ids=None,
            common_set=(),
            own_tables=tables,
            own_lengths=lengths,
            mask=mask,
        )
        return backend._decode(queries, kv_cache, plan)

    return paged


def paged_cache(k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, block: int = 16) -> Tensors:
    """K and V [decodes, kv_heads, keys, dim] as the engine's cache [2, blocks, block,
    kv_heads, dim] of `block`-token blocks in shuffled order, with each decode's block table
    and length (its mask's count)."""
    decodes, kv_heads, keys, dim = k.shape
    blocks = -(-keys // block)
    order = torch.randperm(decodes * blocks, generator=torch.Generator().manual_seed(1))
    kv_cache = torch.empty(2, decodes * blocks, block, kv_heads, dim, dtype=k.dtype)
    for cache, x in zip(kv_cache, (k, v), strict=True):
        padded = F.pad(x.transpose(1, 2), (0, 0, 0, 0, 0, blocks * block - keys))
        cache[order] = padded.reshape(decodes * blocks, block, kv_heads, dim)
    lengths = mask.reshape(decodes, keys).sum(-1)
    return kv_cache, order.view(decodes, blocks), lengths


def cases(dtype: torch.dtype) -> dict[str, tuple[float, Tensors, dict[str, Callable]]]:
    """name → (attended pairs, inputs, variants); every variant returns the output."""
    gen = torch.Generator().manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype)

    q = randn(DECODES, KV_HEADS, GROUP, DIM)
    common_k, common_v = randn(1, KV_HEADS, COMMON, DIM), randn(1, KV_HEADS, COMMON, DIM)
    own_k, own_v = randn(DECODES, KV_HEADS, OWN, DIM), randn(DECODES, KV_HEADS, OWN, DIM)
    lengths = torch.randint(1, OWN + 1, (DECODES, 1, 1, 1), generator=gen)
    own_mask = torch.arange(OWN)[None, None, None, :] < lengths
    sets = variant_sets(dtype, lengths.view(DECODES, 1).expand(DECODES, GROUP))
    folded = q.permute(1, 0, 2, 3).reshape(1, KV_HEADS, DECODES * GROUP, DIM)
    rows, own_pairs = DECODES * GROUP, int(lengths.sum()) * HEADS
    alone = tuple(randn(DECODES, KV_HEADS, n, DIM) for n in (GROUP, ALONE, ALONE))
    out: dict[str, tuple[float, Tensors, dict[str, Callable]]] = {
        "decode-common": (rows * COMMON * KV_HEADS, (folded, common_k, common_v), sets["dense"]),
        "decode-own": (own_pairs, (q, own_k, own_v, own_mask), sets["own"]),
        "decode-common+own": (
            rows * COMMON * KV_HEADS + own_pairs,
            (q, common_k, common_v, own_k, own_v, own_mask),
            {"bf16-scores": bf16_scores},
        ),
        "prefill-common": (
            32 * rows * COMMON * KV_HEADS,
            (randn(1, KV_HEADS, 32 * rows, DIM), common_k, common_v),
            sets["dense"],
        ),
        "decode-alone": (
            rows * ALONE * KV_HEADS,
            (*alone, torch.ones(DECODES, 1, 1, ALONE, dtype=torch.bool)),
            sets["alone"],
        ),
    }
    for n in (544, 1056):
        inputs = tuple(randn(1, heads, n, DIM) for heads in (HEADS, KV_HEADS, KV_HEADS))
        out[f"causal-{n}"] = (n * (n + 1) // 2 * HEADS, inputs, sets["causal"])
    return out


def reference(name: str, inputs: Tensors) -> torch.Tensor:
    if name == "decode-common+own":
        return two_part_reference(*inputs)
    if name in ("decode-own", "decode-alone"):
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
