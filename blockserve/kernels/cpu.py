"""The typed operator table of our CPU kernels (csrc/cpu): for a tensor, the loaded kernel
that serves it or None, where torch's operators serve with the same result up to rounding.
Two libraries, bf16 (AVX512-BF16, AMX tiles where present) and f32 (AVX2, or AVX-512F);
docs/cpu-kernels.md says what each operator computes."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from blockserve.kernels.build import LIBRARIES
from blockserve.kernels.loader import KernelLoader

HEAD_DIM = 64
VECTOR_MAX_ROWS = 128  # the most rows a float32 product takes our vector kernel for
# The fewest rows a bf16 product is widened to float32 for over its wide copy, where widening
# pays (model/weight_copies.py); fewer take our bf16 vector kernel. Over SmolLM2-135M's 121
# layers in the engine (benchmarks/bench_wide_products.py; 2 vCPUs, an AVX512-BF16 Xeon without
# AMX) a step of products took 216.4 ms on the vectors and 227.1 on the wide copies at 160
# rows, 267.2 and 256.4 at 192 (once the vector kernel widened x itself; before, the two met at
# ~80 rows).
WIDE_MIN_ROWS = 176
# The fewest rows a bf16 product runs in half precision for over its half copy, where the CPU
# has AVX512-FP16 and no AMX (model/weight_copies.py); fewer take our bf16 vector kernel. On
# the same Xeon a step of products took 31.5 ms on the vectors and 38.2 in half precision at 16
# rows, 60.5 and 57.6 at 32, 85.2 and 61.8 at 64 (benchmarks/bench_wide_products.py).
HALF_MIN_ROWS = 32
MAX_DECODE_GROUP = 8  # query heads per KV head that paged_decode takes


def fits_model(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether a model on `device` in `dtype` with `head_dim` would use our kernels."""
    return device.type == "cpu" and dtype in LIBRARIES and head_dim == HEAD_DIM


class LayerOpsSource(Protocol):
    """What a model asks each eager forward for its fused layer operators (None: torch's)."""

    def layer_ops(self, hidden: torch.Tensor, head_dim: int) -> Any: ...


@dataclass(slots=True)
class KernelSwitches:
    """Which of the loaded kernels serve (benchmarks and tests compare them with torch's)."""

    attention: bool = True  # dense and prefix attention
    paged: bool = True  # the decodes' one-call attention
    layer: bool = True  # RMSNorm, rotary, SiLU, argmax, the K/V write
    products: bool = True  # our products (bf16 on AMX tiles, float32 on vectors, widened bf16)
    tiles: bool = True  # AMX tiles where the CPU has them
    lora: bool = True  # LoRA's grouped products (else torch's bmm)
    vector_max_rows: int = VECTOR_MAX_ROWS
    wide_min_rows: int = WIDE_MIN_ROWS
    half_min_rows: int = HALF_MIN_ROWS


class CpuKernels:
    """Our kernels for one runner: a loader and the switches. A fresh one has nothing loaded
    and gives None everywhere (torch serves). The lookups run for every layer of every step,
    so they test `is_cpu` rather than build a tensor's device to read its type."""

    def __init__(self, loader: KernelLoader | None = None) -> None:
        self.loader = loader if loader is not None else KernelLoader()
        self.switches = KernelSwitches()

    def set_enabled(
        self,
        on: bool,
        *,
        paged: bool | None = None,
        layer: bool | None = None,
        products: bool | None = None,
    ) -> None:
        """Switch the loaded kernels out (torch serves) and back in; `paged`, `layer` and
        `products` switch those alone (default: as `on`)."""
        self.switches.attention = on
        self.switches.paged = on if paged is None else paged
        self.switches.layer = on if layer is None else layer
        self.switches.products = on if products is None else products

    def use_amx(self, on: bool) -> bool:
        """Run bf16 attention and few-row products on AMX tiles (the default where the CPU has
        AMX-BF16) or not; whether the tiles are now in use."""
        self.switches.tiles = on
        ops = self.loader.ops(torch.bfloat16)
        return ops is not None and bool(ops.use_amx(on))

    def use_wide_attention(self, on: bool) -> bool:
        """Run bf16 attention's products on float32 FMAs over the pairs widened (where they
        outrun bf16 dot products: weight_copies.widening_pays) or not (the default); whether
        they are now in use: never where the tiles are."""
        ops = self.loader.ops(torch.bfloat16)
        return ops is not None and bool(ops.use_wide_attention(on))

    def _attention_ops(self, x: torch.Tensor, *, paged: bool = False) -> Any:
        """The loaded operators for tensors like `x` (head dimension last), or None."""
        if not self.switches.attention or (paged and not self.switches.paged):
            return None
        if not fits_model(x.device, x.dtype, x.shape[-1]):
            return None
        return self.loader.ops(x.dtype)

    def dense_attention(self, q: torch.Tensor) -> Callable[..., Any] | None:
        """For query rows like `q` against keys given whole."""
        ops = self._attention_ops(q)
        return None if ops is None else ops.dense_attention

    def prefix_attention(self, q: torch.Tensor) -> Callable[..., Any] | None:
        """For rows like `q` against whole blocks read in place (a shared prefix's)."""
        ops = self._attention_ops(q)
        return None if ops is None else ops.prefix_attention

    def pack_common(self, q: torch.Tensor) -> Callable[..., torch.Tensor] | None:
        """The packing of whole cached blocks for `prefix_attention` (its `packed`)."""
        ops = self._attention_ops(q)
        return None if ops is None else ops.pack_common

    def decode_attention(self, q: torch.Tensor) -> Callable[..., torch.Tensor] | None:
        """A decode step's attention in one call: the common blocks, then each sequence's own
        blocks read in place, continuing from there."""
        ops = self._attention_ops(q, paged=True)
        return None if ops is None else ops.decode_attention

    def layer_ops(self, hidden: torch.Tensor, head_dim: int) -> Any:
        """The fused layer operators for an eager forward on `hidden` (hidden size a multiple
        of 16, a model `fits_model` names)."""
        if (
            not self.switches.layer
            or hidden.shape[-1] % 16
            or not fits_model(hidden.device, hidden.dtype, head_dim)
        ):
            return None
        return self.loader.ops(hidden.dtype)

    def argmax(self, x: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """torch.max's indices along the last dimension (the first of equal maxima, the first
        NaN) for [rows, n] tensors, n ≥ 1, unit stride along it."""
        if (
            not self.switches.layer
            or not x.is_cpu
            or x.dim() != 2
            or x.shape[1] == 0
            or x.stride(1) != 1
        ):
            return None
        ops = self.loader.ops(x.dtype)
        return None if ops is None else ops.argmax_rows

    def write_kv(
        self, kv_cache: torch.Tensor, slots: torch.Tensor, key: torch.Tensor, value: torch.Tensor
    ) -> Callable[..., None] | None:
        """A step's K and V ([tokens, kv_heads, dim], heads contiguous) written into a layer's
        contiguous CPU cache at int64 `slots` in one call."""
        if (
            not self.switches.layer
            or not kv_cache.is_cpu
            or not kv_cache.is_contiguous()
            or slots.dtype != torch.int64
            or key.stride(-1) != 1
            or key.stride(-2) != key.shape[-1]
            or value.stride(-1) != 1
            or value.stride(-2) != value.shape[-1]
        ):
            return None
        ops = self.loader.ops(key.dtype)
        return None if ops is None else ops.write_kv_

    def tile_linear(self, x: torch.Tensor) -> Callable[..., torch.Tensor] | None:
        """The bf16 product on AMX tiles, where the CPU has AMX-BF16."""
        ops = self._tile_ops(x)
        return None if ops is None else ops.tile_linear

    def tile_linear_silu(self, x: torch.Tensor) -> Callable[..., torch.Tensor] | None:
        """The MLP's gate/up product on AMX tiles with SiLU(gate) · up applied to its
        results (tile_linear, then silu_and_mul, in one pass), where the CPU has AMX-BF16."""
        ops = self._tile_ops(x)
        return None if ops is None else ops.tile_linear_silu

    def _tile_ops(self, x: torch.Tensor) -> Any:
        if (
            not self.loader.has_tiles
            or not (self.switches.tiles and self.switches.products)
            or x.dtype != torch.bfloat16
            or not x.is_cpu
        ):
            return None
        return self.loader.ops(torch.bfloat16)

    def gguf_linear(self, x: torch.Tensor) -> Callable[..., torch.Tensor] | None:
        """The bf16 product of few rows over a GGUF weight's blocks (Q4_0, Q4_1, Q8_0), x
        rounded to 8 bits per block of 32 (csrc/cpu/linear_gguf.cpp)."""
        if not self.switches.products or x.dtype != torch.bfloat16 or not x.is_cpu:
            return None
        ops = self.loader.ops(torch.bfloat16)
        return None if ops is None else ops.gguf_linear

    def widens(self, x: torch.Tensor) -> bool:
        """Whether a bf16 product of the rows `x` runs widened to float32, over its layer's
        wide copy (made where that pays: model/weight_copies.py): `wide_min_rows` rows or more."""
        return self.switches.products and x.shape[0] >= self.switches.wide_min_rows

    def half_linear(self, x: torch.Tensor) -> Callable[..., torch.Tensor] | None:
        """The bf16 product of `half_min_rows` rows or more on half-precision FMAs, over its
        layer's half copy (made where the CPU has AVX512-FP16 and no AMX: model/weight_copies.py;
        csrc/cpu/linear_f16.cpp says how near its sums are to float32's)."""
        ops = self._half_ops(x)
        return None if ops is None else ops.half_linear

    def half_linear_sums(self, x: torch.Tensor) -> Callable[..., torch.Tensor] | None:
        """`half_linear`'s float32 sums, unrounded (for silu_and_mul_sums)."""
        ops = self._half_ops(x)
        return None if ops is None else ops.half_linear_sums

    def _half_ops(self, x: torch.Tensor) -> Any:
        if (
            not self.switches.products
            or x.dtype != torch.bfloat16
            or not x.is_cpu
            or x.shape[0] < self.switches.half_min_rows
            or x.stride(-1) != 1
        ):
            return None
        return self.loader.ops(torch.bfloat16)

    def lora_add(self, x: torch.Tensor) -> Callable[..., None] | None:
        """LoRA's grouped shrink and expand of one projection, added to its output in place
        (csrc/cpu/lora.h), for CPU rows like `x` of unit stride."""
        if not self.switches.lora or not x.is_cpu or x.stride(-1) != 1:
            return None
        ops = self.loader.ops(x.dtype)
        return None if ops is None else ops.lora_add_

    def vector_linear(self, x: torch.Tensor, isa: str | None) -> Callable[..., torch.Tensor] | None:
        """The product of few rows over a weight packed by the `isa` build, that build being
        loaded: float32 (each build packs for its own vector width) up to `vector_max_rows`
        rows; bf16 widened to float32 as it is read, fewer than `wide_min_rows` (more take the
        wide copy; a layer's half copy, where it has one, takes `half_min_rows` or more), where
        widening pays (model/weight_copies.py)."""
        if x.dtype == torch.float32:
            most = self.switches.vector_max_rows
        elif x.dtype == torch.bfloat16:
            most = self.switches.wide_min_rows - 1
        else:
            return None
        ops = self.loader.ops(x.dtype)
        if (
            ops is None
            or not self.switches.products
            or not x.is_cpu
            or isa is None
            or self.loader.isa(x.dtype) != isa
            or x.shape[0] > most
        ):
            return None
        return ops.vector_linear
