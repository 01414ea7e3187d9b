"""Our CPU kernels, built with the host's g++ and loaded into torch as operators: two
libraries, one per dtype a model is served in on a CPU.

- `bf16`, for x86 CPUs with AVX512-BF16 (cpu_dense_bf16.cpp, cpu_layer_bf16.cpp,
  cpu_linear_bf16.cpp), as the `blockserve_cpu` operators; where the CPU also has AMX-BF16,
  dense and prefix attention run their products on its tiles, and so do linear layers' products
  of few rows (`tile_linear`, model/packed.py) (`use_amx`).
- `f32`, for x86 CPUs with AVX2 and FMA (cpu_dense_f32.cpp, cpu_layer_f32.cpp,
  cpu_linear_f32.cpp): float32, what `auto` picks where bf16 is not native; its linear layers'
  products of few rows run on our vector kernel (`vector_linear`, model/packed.py). Two
  builds: `blockserve_cpu_f32` for AVX2, and `blockserve_cpu_f32_avx512`, computing on sixteen
  lanes, for CPUs with AVX-512F; a host loads the widest it can run.

Both have the same attention and layer operators, for head dimension 64. The attention ones
(cpu_attention.h) serve the torch backend: `dense_attention` for prefills one by one and each
sequence's own blocks after a shared prefix (docs/benchmarks.md, "Attention on the workloads'
shapes"); `prefix_attention` for a shared prefix's common blocks, read in place;
`paged_decode` for decodes, reading each sequence's own blocks in place, continuing from
the common blocks' result (the two in one call: `decode_attention`). The layer ones
(`rms_norm`, `add_rms_norm`, `rotary_`, `silu_and_mul`, cpu_layer.h) serve an eager
forward's elementwise math (`layer_ops`). Elsewhere, or while they build, or if they cannot
be built, torch's operators serve: the result is the same up to rounding.

A build (~25 s, once per host, torch and sources: cpu_build.py) runs on a thread of its own
when an engine starts, so start-up does not wait for it (cpu_loader.py: `start_loading`,
`load`, `when_loaded`, `wait`, re-exported here); until then torch's operators serve.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from blockserve.attention import cpu_loader
from blockserve.attention.cpu_build import LIBRARIES
from blockserve.attention.cpu_build import supported as supported

# The loading, for callers that reach it through this module.
from blockserve.attention.cpu_loader import load as load
from blockserve.attention.cpu_loader import loaded as loaded
from blockserve.attention.cpu_loader import loaded_isa
from blockserve.attention.cpu_loader import start_loading as start_loading
from blockserve.attention.cpu_loader import wait as wait
from blockserve.attention.cpu_loader import when_loaded as when_loaded

HEAD_DIM = 64
# The most rows a float32 product takes our vector kernel for, in either build: oneDNN's
# products are as fast past them (docs/benchmarks.md, "Float32 on AVX-512F").
VECTOR_MAX_ROWS = 128
MAX_DECODE_GROUP = 8  # query heads per KV head that paged_decode takes

_enabled = True
_paged_enabled = True
_layer_enabled = True
_tiles_wanted = True  # use_amx
_products_enabled = True


def serves(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether a model on `device` in `dtype` with `head_dim` would use our kernels."""
    return device.type == "cpu" and dtype in LIBRARIES and head_dim == HEAD_DIM


def _ops_for(x: torch.Tensor) -> Any:
    """The loaded operators for tensors like `x` (head dimension last), or None."""
    if not serves(x.device, x.dtype, x.shape[-1]):
        return None
    return cpu_loader.ops(x.dtype)


def dense_attention(q: torch.Tensor) -> Callable[..., tuple[torch.Tensor, torch.Tensor]] | None:
    """The loaded kernel for query rows like `q` against keys given whole, or None: never
    waits."""
    ops = _ops_for(q) if _enabled else None
    return None if ops is None else ops.dense_attention


def prefix_attention(q: torch.Tensor) -> Callable[..., tuple[torch.Tensor, torch.Tensor]] | None:
    """The loaded kernel for rows like `q` against whole blocks read in place (a shared
    prefix's common blocks), or None: switched with `dense_attention`."""
    ops = _ops_for(q) if _enabled else None
    return None if ops is None else ops.prefix_attention


def pack_common(q: torch.Tensor) -> Callable[..., torch.Tensor] | None:
    """The loaded packing of whole cached blocks for `prefix_attention` (its `packed`
    argument), for rows like `q`, or None: switched with it."""
    ops = _ops_for(q) if _enabled else None
    return None if ops is None else ops.pack_common


def decode_attention(q: torch.Tensor) -> Callable[..., torch.Tensor] | None:
    """The loaded decode step's attention in one call for queries like `q`, or None: the
    common blocks through `prefix_attention`, then each sequence's own blocks read in place
    through `paged_decode`, continuing from there, in q's dtype. Switched with the paged
    decode, and off with `prefix_attention` too (it runs that kernel)."""
    ops = _ops_for(q) if _enabled and _paged_enabled else None
    return None if ops is None else ops.decode_attention


def layer_ops(hidden: torch.Tensor, head_dim: int) -> Any:
    """The fused layer operators for an eager forward whose hidden states are `hidden`, or
    None where torch's operators serve: not loaded or switched off, a model `serves` does not
    name, a hidden size not a multiple of 16."""
    if (
        not _layer_enabled
        or hidden.shape[-1] % 16
        or not serves(hidden.device, hidden.dtype, head_dim)
    ):
        return None
    return cpu_loader.ops(hidden.dtype)


def argmax(x: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """Our argmax along the last dimension of `x`, or None: the indices of torch.max (the
    first of equal maxima, the first NaN) from one vectorized pass, for [rows, n] tensors
    (n ≥ 1, unit stride along it) in either library's dtype; switched with the layer
    operators."""
    if (
        not _layer_enabled
        or x.device.type != "cpu"
        or x.dim() != 2
        or x.shape[1] == 0
        or x.stride(1) != 1
    ):
        return None
    ops = cpu_loader.ops(x.dtype)
    return None if ops is None else ops.argmax_rows


def write_kv(
    kv_cache: torch.Tensor, slots: torch.Tensor, key: torch.Tensor, value: torch.Tensor
) -> Callable[..., None] | None:
    """Our write of a step's K and V ([tokens, kv_heads, dim], each token's heads contiguous)
    into a layer's cache (contiguous, on the CPU) at int64 `slots`, both in one call
    (`write_kv_`), or None where two index_copy_ serve: another layout, or the layer
    operators switched off."""
    if (
        not _layer_enabled
        or kv_cache.device.type != "cpu"
        or not kv_cache.is_contiguous()
        or slots.dtype != torch.int64
        or any(t.stride(-1) != 1 or t.stride(-2) != t.shape[-1] for t in (key, value))
    ):
        return None
    ops = cpu_loader.ops(key.dtype)
    return None if ops is None else ops.write_kv_


def tile_linear(x: torch.Tensor) -> Callable[..., torch.Tensor] | None:
    """Our product of few rows on AMX tiles (cpu_linear_bf16.cpp) for rows like `x`, or None:
    bf16 on a CPU with AMX-BF16 once the library is loaded, and not switched off."""
    tiles = cpu_loader.tile_ops()
    if tiles is None or not (_tiles_wanted and _products_enabled) or x.dtype != torch.bfloat16:
        return None
    return tiles.tile_linear if x.device.type == "cpu" else None


def vector_linear(x: torch.Tensor, isa: str | None) -> Callable[..., torch.Tensor] | None:
    """Our float32 product of few rows (cpu_linear_f32.cpp) for rows like `x` over a weight
    packed by the `isa` build (`vector_pack`: each build packs for its own vector width), or
    None: the float32 library's `isa` build loaded, at most `VECTOR_MAX_ROWS` rows, and not
    switched off (`enable(products=False)`)."""
    ops = cpu_loader.ops(torch.float32)
    if (
        ops is None
        or not _products_enabled
        or x.dtype != torch.float32
        or x.device.type != "cpu"
        or isa is None
        or loaded_isa(torch.float32) != isa
        or x.shape[0] > VECTOR_MAX_ROWS
    ):
        return None
    return ops.vector_linear


def use_amx(on: bool) -> bool:
    """Run bf16 attention and few-row products on AMX tiles (the default where the CPU has
    AMX-BF16) or not (AVX512-BF16 vectors for attention, oneDNN's products): tests and
    benchmarks compare the two. Whether the tiles are now in use: never where the CPU has no
    AMX or the bf16 library is not loaded."""
    global _tiles_wanted
    _tiles_wanted = on
    ops = cpu_loader.ops(torch.bfloat16)
    return ops is not None and bool(ops.use_amx(on))


def enable(
    on: bool,
    *,
    paged: bool | None = None,
    layer: bool | None = None,
    products: bool | None = None,
) -> None:
    """Switch the loaded kernels out (torch serves) and back in: benchmarks compare the two.
    `paged` switches the decodes' path alone (`decode_attention`), `layer` the fused layer
    operators, `products` the few-row products (bf16 on AMX tiles, float32 on vectors;
    oneDNN's serve) (default: as `on`)."""
    global _enabled, _paged_enabled, _layer_enabled, _products_enabled
    _enabled = on
    _paged_enabled = on if paged is None else paged
    _layer_enabled = on if layer is None else layer
    _products_enabled = on if products is None else products
