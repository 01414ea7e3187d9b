"""Linear layers over weights reordered once into oneDNN's blocked layout (CPU), equal to
`F.linear` (to the bit in bf16); each dispatches a product by its rows to our kernels over the
copies of its weight that model/weight_copies.py makes (docs/cpu-kernels.md), or to oneDNN's
(always in compiled graphs)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from blockserve.kernels import CpuKernels
from blockserve.platform import probe_host

# The most rows a product takes a GGUF weight's blocks for: beyond, the tile copy's bf16 is
# faster (benchmarks/bench_gguf_linear.py).
GGUF_MAX_ROWS = 8
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
