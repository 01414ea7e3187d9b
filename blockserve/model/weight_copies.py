"""The copies of each `PackedLinear`'s weight our CPU kernels run over, made once the kernels'
library is loaded: tile order (AMX), panels (few rows), half precision scaled by columns
(AVX512-FP16) or widened to float32, and a GGUF file's blocks; each kind for all layers or none,
within a share of the host's free memory (docs/cpu-kernels.md)."""

from __future__ import annotations

import logging
import os
import time
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from blockserve.kernels import CpuKernels
from blockserve.model.packed import PackedLinear
from blockserve.platform import host_memory

logger = logging.getLogger(__name__)
# Logged once the copies of the weights our kernels run over are made (benchmarks wait for it).
WEIGHT_COPIES_MADE = "weight copies for our CPU kernels made"

# Each kind of copy of a model's weights (tile, vector, half or wide: all its layers or none)
# takes at most this share of the memory the host has available when it is made (copy_budget):
# the rest stays for activations, the KV cache and other processes.
COPY_SHARE = 0.5
# A bf16 product runs over its weight widened to float32 (a "wide" copy) where this core's
# float32 FMAs outrun its bf16 dot products by WIDE_GAIN (csrc/cpu/dot_rates.cpp), for a
# prefill's rows, bound by arithmetic (CpuKernels.widens); fewer rows take our vector kernel
# over a bf16 panel copy. On a 2-vCPU AVX512-BF16 Xeon without AMX the dot products ran at
# 64-89 GFLOP/s a core, the FMAs at 162-179, and oneDNN's products of 2,048 rows of
# SmolLM2-135M's layers at 169-172 in bf16 and 258-291 widened (benchmarks/bench_floor.py).
WIDE_GAIN = 1.25
# Where the CPU has AVX512-FP16 (and no AMX), the products of many rows run in half precision
# over a "half" copy instead (csrc/cpu/linear_f16.cpp: twice the FMAs' FLOPs, sums off
# float32's by less than a bf16 rounding); this variable at 0 keeps them widened.
HALF_PRODUCTS_ENV = "BLOCKSERVE_HALF_PRODUCTS"


def pack_for_tiles(model: nn.Module, ops: Any) -> int:
    """Give each `PackedLinear` under `model` that our tile kernel takes a copy of its weight
    in tile order (`ops`: our loaded bf16 operators), unless the CPU has no AMX-BF16 or the
    copies would pass `copy_budget()`; returns how many got one."""
    if not ops.has_amx():
        return 0
    linears = _to_copy(model, PackedLinear.tileable, "tile")
    for linear in linears:
        linear.tiles = ops.tile_pack(linear.dense_weight())
    return len(linears)


def widening_pays(ops: Any) -> bool:
    """Whether this CPU's bf16 prefill products run faster widened to float32 (`ops`: our
    loaded bf16 operators): it has no AMX tiles, and its float32 FMAs outrun its bf16 dot
    products by `WIDE_GAIN` (the rates of one core, measured now in about 2 ms)."""
    if ops.has_amx():
        return False
    bf16, f32 = ops.dot_rates()
    pays = f32 >= WIDE_GAIN * bf16
    logger.info(
        "bf16 dot products %.0f GFLOP/s, float32 FMAs %.0f a core: prefill products in %s",
        bf16,
        f32,
        "float32" if pays else "bf16",
    )
    return pays


def halving_pays(ops: Any) -> bool:
    """Whether this CPU's bf16 products of many rows run in half precision (`ops`: our loaded
    bf16 operators): it has AVX512-FP16 and no AMX tiles, and `HALF_PRODUCTS_ENV` is not 0."""
    if os.environ.get(HALF_PRODUCTS_ENV, "1") == "0" or ops.has_amx():
        return False
    return bool(ops.has_half())


def pack_halves(model: nn.Module, ops: Any) -> int:
    """Give each `PackedLinear` under `model` that our half-precision kernel takes a copy of
    its weight in that kernel's order, scaled by columns into half precision (`ops`: our
    loaded bf16 operators), unless the copies would pass `copy_budget()`; returns how many
    got one."""
    linears = _to_copy(model, PackedLinear.halvable, "half")
    for linear in linears:
        halves, scales = ops.half_pack(linear.dense_weight())
        linear.half_scales = scales  # first: requests served meanwhile take `halves` once set
        linear.halves = halves
    return len(linears)


def pack_wide(model: nn.Module, drop_packed: bool = False) -> int:
    """Give each bf16 `PackedLinear` under `model` a copy of its weight widened to float32 in
    oneDNN's layout, for the products of many rows (`CpuKernels.widens`), unless the copies
    would pass `copy_budget()`; returns how many got one. `drop_packed`: a layer that has its
    panel copy too drops oneDNN's bf16 weight as its wide copy is made (the two copies serve
    every product; only the layer being widened holds all three)."""
    linears = _to_copy(model, PackedLinear.widenable, "wide", bytes_per_weight=4)
    for linear in linears:
        widened = linear.dense_weight().float()
        linear.wide = torch.ops.mkldnn._reorder_linear_weight(widened, None)
        if drop_packed and linear.vectors is not None:
            linear.packed = None
    return len(linears)


def pack_for_gguf(model: nn.Module, ops: Any) -> int:
    """Put each GGUF weight's blocks under `model` into the order our kernel reads (`ops`: our
    loaded bf16 operators); returns how many."""
    linears = [
        m
        for m in model.modules()
        if isinstance(m, PackedLinear) and m.gguf is not None and not m.gguf_packed
    ]
    for linear in linears:
        linear.gguf, linear.gguf_packed = ops.gguf_pack(linear.gguf, linear.gguf_type), True
    return len(linears)


def pack_for_vectors(model: nn.Module, ops: Any, isa: str) -> int:
    """Give each `PackedLinear` under `model` that our vector kernels take a copy of its weight
    in panel order (`ops`: the loaded build of the model's dtype, named `isa`), unless the
    copies would pass `copy_budget()`; returns how many got one."""
    linears = _to_copy(model, PackedLinear.vectorizable, "vector")
    for linear in linears:
        linear.vectors, linear.vectors_isa = ops.vector_pack(linear.dense_weight()), isa
    return len(linears)


def use_kernels(model: nn.Module, kernels: CpuKernels) -> None:
    """Hand every `PackedLinear` under `model` the kernels that run over its copies."""
    for module in model.modules():
        if isinstance(module, PackedLinear):
            module.kernels = kernels


def pack_once_loaded(
    model: weakref.ref[nn.Module], kernels: CpuKernels, dtype: torch.dtype, compiled: bool = False
) -> Callable[[Any], None]:
    """What to run once `kernels` has `dtype`'s library loaded (on its loader's thread, given
    its operators): the tile copies and GGUF blocks (bf16; and where widening pays, attention
    widened, the panel copies, and the half copies where `halving_pays`, else the wide ones
    with oneDNN's bf16 weights dropped unless the forward is `compiled` over them) or the
    panel copies for the build loaded (float32) of the model's weights, unless the model is
    gone by then."""

    def pack(ops: Any) -> None:
        if (alive := model()) is None:
            return
        started = time.perf_counter()
        isa = kernels.loader.isa(dtype)
        if dtype == torch.bfloat16:
            pack_for_tiles(alive, ops)
            pack_for_gguf(alive, ops)
            if isa is not None and widening_pays(ops):
                kernels.use_wide_attention(True)
                pack_for_vectors(alive, ops, isa)  # first: every request's decode runs on them
                if halving_pays(ops):
                    pack_halves(alive, ops)
                else:
                    pack_wide(alive, drop_packed=not compiled)
        elif isa is not None:
            pack_for_vectors(alive, ops, isa)
        # Requests are served meanwhile, on the copies made so far (SmolLM2-135M: about a
        # second; a 1B model: some 35 s on a 2-vCPU host, its first requests slower).
        logger.info("%s in %.1f s", WEIGHT_COPIES_MADE, time.perf_counter() - started)

    return pack


def copy_budget() -> int:
    """The most bytes one kind of copy of a model's weights may take now: `COPY_SHARE` of the
    host's available memory."""
    return int(COPY_SHARE * host_memory().free)


def _to_copy(
    model: nn.Module,
    takes: Callable[[PackedLinear], bool],
    kind: str,
    bytes_per_weight: int | None = None,
) -> list[PackedLinear]:
    """The `PackedLinear`s under `model` a kernel `takes`; none (logged) if copies of their
    weights, `bytes_per_weight` each (default: the weights' own), would pass `copy_budget()`."""
    linears = [m for m in model.modules() if isinstance(m, PackedLinear) and takes(m)]
    size = sum(
        m.in_features * m.out_features * (bytes_per_weight or m.dtype.itemsize) for m in linears
    )
    if size > (budget := copy_budget()):
        logger.info(
            "%s copies of the linear weights would take %.1f GiB, past %.1f (%g of the memory "
            "available): none made",
            kind,
            size / 2**30,
            budget / 2**30,
            COPY_SHARE,
        )
        return []
    return linears
