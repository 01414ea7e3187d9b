"""Linear layers over weights reordered once into oneDNN's blocked layout (CPU), equal to
`F.linear` (to the bit in bf16). Our tile (bf16, AMX), vector (few rows) and half-precision
(AVX512-FP16) kernels, and bf16 prefills widened to float32 where FMAs outrun bf16 dot products,
run over copies of each weight (docs/cpu-kernels.md); compiled graphs use oneDNN's."""

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
from blockserve.platform import host_memory, probe_host

logger = logging.getLogger(__name__)
# Logged once the copies of the weights our kernels run over are made (benchmarks wait for it).
WEIGHT_COPIES_MADE = "weight copies for our CPU kernels made"

# The most rows a product takes a GGUF weight's blocks for: beyond, the tile copy's bf16 is
# faster (benchmarks/bench_gguf_linear.py).
GGUF_MAX_ROWS = 8
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

_LIBRARY = torch.library.Library("blockserve", "FRAGMENT")
_LIBRARY.define("packed_linear(Tensor x, Tensor packed, Tensor? bias) -> Tensor")


def _packed_linear(
    x: torch.Tensor,  # [rows, in_features]
    packed: torch.Tensor,  # the weight in oneDNN's layout; its shape is [out, in]
    bias: torch.Tensor | None,
) -> torch.Tensor:  # [rows, out_features]
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def wide_linear(
    x: torch.Tensor,  # [rows, in_features], bf16
    wide: torch.Tensor,  # the weight widened to float32, in oneDNN's layout (pack_wide)
    bias: torch.Tensor | None,
) -> torch.Tensor:  # [rows, out_features], x's dtype: the float32 sums rounded once
    wide_bias = None if bias is None else bias.float()
    return _packed_linear(x.float(), wide, wide_bias).to(x.dtype)


# A thin registration: torch.library.custom_op's wrapper costs more per call than the
# decode-sized product can spare.
_LIBRARY.impl("packed_linear", _packed_linear, "CompositeExplicitAutograd")


@torch.library.register_fake("blockserve::packed_linear")
def _packed_linear_fake(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    return x.new_empty(x.shape[0], packed.shape[0])


# The CPU features oneDNN needs to reorder (and compute) a bf16 weight, any one set of them.
ONEDNN_BF16_NEEDS = (("avx512_bw", "avx512_vl", "avx512_dq"), ("avx_ne_convert",))


def can_prepack(
    device: torch.device | str,
    dtype: torch.dtype = torch.float32,
    cpu_flags: frozenset[str] | None = None,
) -> bool:
    """Whether a `dtype` model's linears on `device` can be reordered for oneDNN: float32 on
    any CPU build with oneDNN, bfloat16 only where oneDNN takes it (`ONEDNN_BF16_NEEDS`; an
    AVX2-only CPU does not, and keeps `nn.Linear`'s generic path). `cpu_flags`: torch's names
    of the CPU's features, this CPU's by default."""
    if torch.device(device).type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.float32:
        return True
    if dtype != torch.bfloat16:
        return False
    if cpu_flags is None:
        cpu_flags = probe_host(torch.device("cpu")).cpu_flags
    return any(cpu_flags.issuperset(needs) for needs in ONEDNN_BF16_NEEDS)


class PackedLinear(nn.Module):
    """An `nn.Linear`'s forward over a weight reordered for oneDNN (the original is dropped)."""

    packed: torch.Tensor | None  # None once the panel and wide copies serve every product
    dtype: torch.dtype  # the weight's
    bias: torch.Tensor | None
    tiles: torch.Tensor | None  # the weight in tile order (pack_for_tiles), or None
    vectors: torch.Tensor | None  # the weight in panel order (pack_for_vectors), or None
    vectors_isa: str | None  # the build that packed `vectors`
    wide: torch.Tensor | None  # the bf16 weight widened to float32, for oneDNN (pack_wide)
    halves: torch.Tensor | None  # the weight scaled to half precision by columns (pack_halves)
    half_scales: torch.Tensor | None  # each column's scale, float32
    kernels: CpuKernels | None  # ours, which run over the copies (use_kernels)
    gguf: torch.Tensor | None  # a GGUF file's blocks of this weight (gguf_weights.attach)
    gguf_type: int  # their GGML type
    gguf_packed: bool  # `gguf` is in our kernel's order (pack_for_gguf)

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        weight = linear.weight.detach()
        self.dtype = weight.dtype
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        self.register_buffer("packed", packed, persistent=False)
        bias = None if linear.bias is None else linear.bias.detach()
        self.register_buffer("bias", bias, persistent=False)
        self.register_buffer("tiles", None, persistent=False)
        self.register_buffer("vectors", None, persistent=False)
        self.vectors_isa = None
        self.register_buffer("wide", None, persistent=False)
        self.register_buffer("halves", None, persistent=False)
        self.register_buffer("half_scales", None, persistent=False)
        self.kernels = None
        self.register_buffer("gguf", None, persistent=False)
        self.gguf_type, self.gguf_packed = 0, False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # A decode step calls this some hundred times, so it costs what it can spare: no
        # reshape of rows that are rows already, the buffers read from their dict (a module's
        # __getattr__ is slower).
        flat = x.dim() == 2
        rows = x if flat else x.reshape(-1, self.in_features)
        if torch.compiler.is_compiling():
            out = torch.ops.blockserve.packed_linear(rows, self.packed, self.bias)
            return out if flat else out.view(*x.shape[:-1], self.out_features)
        buffers, kernels, num_rows = self._buffers, self.kernels, rows.shape[0]
        # oneDNN's weight read first: the loader's thread drops it only once `wide` is set
        bias, packed = buffers["bias"], buffers["packed"]
        if (
            self.gguf_packed
            and num_rows <= GGUF_MAX_ROWS
            and kernels is not None
            and (gguf_linear := kernels.gguf_linear(rows)) is not None
        ):
            out = gguf_linear(rows, buffers["gguf"], self.gguf_type, bias)
        elif (
            (tiles := buffers["tiles"]) is not None
            and kernels is not None
            and (tile_linear := kernels.tile_linear(rows)) is not None
        ):
            out = tile_linear(rows, tiles, bias)
        elif (
            (halves := buffers["halves"]) is not None
            and kernels is not None
            and (half_linear := kernels.half_linear(rows)) is not None
        ):
            out = half_linear(rows, halves, buffers["half_scales"], bias)
        elif (
            (vectors := buffers["vectors"]) is not None
            and kernels is not None
            and (vector_linear := kernels.vector_linear(rows, self.vectors_isa)) is not None
        ):
            out = vector_linear(rows, vectors, bias)
        elif (wide := buffers["wide"]) is not None and (
            packed is None or (kernels is not None and kernels.widens(rows))
        ):  # where the bf16 weight is gone, oneDNN's products (ours switched off) are these
            out = wide_linear(rows, wide, bias)
        else:
            assert packed is not None, "dropped only beside a wide copy"
            out = _packed_linear(rows, packed, bias)
        return out if flat else out.view(*x.shape[:-1], self.out_features)

    def silu_and_mul(self, x: torch.Tensor, ops: Any) -> torch.Tensor:
        """`ops.silu_and_mul(self(x))` for the MLP's gate/up projection (`ops`: the layer
        operators): SiLU of the output's first half times its second half. Where the product
        runs on the tiles, in one pass: the [rows, out_features] product is never written;
        where it runs widened or in half precision, its float32 sums go to SiLU unrounded,
        which rounds them as it reads them (the same bits, one pass over memory fewer)."""
        rows = x if x.dim() == 2 else x.reshape(-1, self.in_features)
        out = self._silu_in_one_pass(rows, ops)
        if out is None:
            return ops.silu_and_mul(self(x))
        return out if x.dim() == 2 else out.view(*x.shape[:-1], self.out_features // 2)

    def _silu_in_one_pass(self, rows: torch.Tensor, ops: Any) -> torch.Tensor | None:
        """silu_and_mul of this product of `rows` without the bf16 product written, where it
        runs on the tiles, in half precision or widened; None where it runs elsewhere."""
        kernels = self.kernels
        if torch.compiler.is_compiling() or self._buffers["bias"] is not None or kernels is None:
            return None
        if (
            (tiles := self._buffers["tiles"]) is not None
            # few enough rows for the GGUF blocks are theirs
            and not (self.gguf_packed and rows.shape[0] <= GGUF_MAX_ROWS)
            and (fused := kernels.tile_linear_silu(rows)) is not None
        ):
            return fused(rows, tiles)
        if (halves := self._buffers["halves"]) is not None and (
            sums := kernels.half_linear_sums(rows)
        ) is not None:
            return ops.silu_and_mul_sums(sums(rows, halves, self._buffers["half_scales"]))
        if (wide := self._buffers["wide"]) is not None and kernels.widens(rows):
            return ops.silu_and_mul_sums(_packed_linear(rows.float(), wide, None))
        return None

    def tileable(self) -> bool:
        """Whether our tile kernel takes this layer: bf16, both sizes multiples of 32."""
        return (
            self.dtype == torch.bfloat16
            and self.in_features % 32 == 0
            and self.out_features % 32 == 0
        )

    def dense_weight(self) -> torch.Tensor:
        """The weight as a plain row-major [out, in] tensor (what the copies are made from):
        oneDNN's, or the wide copy narrowed back (exact) once oneDNN's is dropped."""
        weight = self.packed if self.packed is not None else self.wide
        assert weight is not None, "a layer keeps oneDNN's weight or its wide copy"
        dense = weight.to_dense() if weight.is_mkldnn else weight
        return dense.to(self.dtype)

    def halvable(self) -> bool:
        """Whether our half-precision kernel takes this layer: bf16, out_features a multiple
        of 64, in_features of 32."""
        return (
            self.dtype == torch.bfloat16
            and self.out_features % 64 == 0
            and self.in_features % 32 == 0
        )

    def widenable(self) -> bool:
        """Whether this layer's products can be widened: its weight is bf16."""
        return self.dtype == torch.bfloat16

    def vectorizable(self) -> bool:
        """Whether our vector kernels take this layer: out_features a multiple of 32, float32,
        or bf16 of even in_features."""
        if self.out_features % 32 != 0:
            return False
        dtype = self.dtype
        return dtype == torch.float32 or (dtype == torch.bfloat16 and self.in_features % 2 == 0)


def prepack_linears(model: nn.Module) -> int:
    """Replace every `nn.Linear` under `model` by a `PackedLinear`; returns how many."""
    targets = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if isinstance(child, nn.Linear)
    ]
    for parent, name, child in targets:
        setattr(parent, name, PackedLinear(child))
    return len(targets)


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
