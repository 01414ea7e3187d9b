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
when an engine starts, so start-up does not wait for it; later starts load the library from
the cache dir in a fraction of a second. `make setup` builds every library the host can run.
That thread is a daemon (exit never waits for a build), so it must not be inside torch's C++
when the interpreter shuts down: a thread stopped there aborts the process. At exit, `_at_exit`
waits for it to leave its C++ (loading the library, the callbacks) and lets it not go back in.
"""

from __future__ import annotations

import atexit
import logging
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from blockserve.attention.cpu_build import (
    LIBRARIES,
    build,
    library_path,
    supported,
    target_for,
)

logger = logging.getLogger(__name__)

HEAD_DIM = 64
# The most rows a float32 product takes our vector kernel for, in either build: oneDNN's
# products are as fast past them (docs/benchmarks.md, "Float32 on AVX-512F").
VECTOR_MAX_ROWS = 128
MAX_DECODE_GROUP = 8  # query heads per KV head that paged_decode takes

_lock = threading.Lock()  # one load (and build) at a time
_start_lock = threading.Lock()
_loaded: dict[torch.dtype, Any] = {}  # dtype → its operators (the torch.ops namespace)
_isas: dict[torch.dtype, str] = {}  # dtype → the instruction set of its loaded build
_loaders: dict[torch.dtype, threading.Thread] = {}
_enabled = True
_paged_enabled = True
_layer_enabled = True
_tiles_wanted = True  # use_amx
_products_enabled = True
_tile_ops: Any = None  # the bf16 operators, once loaded where the CPU has AMX-BF16
_callbacks_lock = threading.Lock()
_when_loaded: dict[torch.dtype, list[Callable[[Any], None]]] = {}
_native = threading.RLock()  # held while a load runs torch's C++: the library, its callbacks
_exiting = False  # the interpreter is shutting down: no load starts its C++ any more


def serves(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether a model on `device` in `dtype` with `head_dim` would use our kernels."""
    return device.type == "cpu" and dtype in LIBRARIES and head_dim == HEAD_DIM


def load(cache_dir: Path, dtype: torch.dtype, isa: str | None = None) -> Any:
    """Build if needed and load `dtype`'s library: its operators (a torch.ops namespace), or
    None (logged) where that fails or the interpreter is exiting. Blocking. The build loaded
    is the widest this CPU runs, or the one named `isa`, which then serves in place of the
    one loaded before (tests and benchmarks compare them; ValueError if the CPU cannot run
    it)."""
    global _tile_ops
    with _lock:
        if dtype in _loaded and (isa is None or _isas[dtype] == isa):
            return _loaded[dtype]
        wanted = target_for(dtype, isa)
        target = library_path(cache_dir, dtype, isa)
        started = time.perf_counter()
        try:
            if not target.exists():
                build(target, dtype, isa)
            with _native:
                if _exiting:
                    return None
                torch.ops.load_library(str(target))
        except (OSError, subprocess.SubprocessError) as error:
            detail = getattr(error, "stderr", "") or ""
            logger.warning("CPU kernels not built, torch's are used: %s %s", error, detail)
            with _callbacks_lock:
                _when_loaded.pop(dtype, None)
            return None
        ops = getattr(torch.ops, wanted.namespace)
        if dtype == torch.bfloat16 and ops.has_amx():
            _tile_ops = ops
        _loaded[dtype], _isas[dtype] = ops, wanted.isa
        seconds = time.perf_counter() - started
        logger.info("CPU kernels ready in %.1f s (%s)", seconds, target)
    with _callbacks_lock:
        callbacks = _when_loaded.pop(dtype, [])
    for callback in callbacks:
        with _native:
            if _exiting:
                break
            _run_callback(callback, ops)
    return ops


@atexit.register
def _at_exit() -> None:
    """Wait for a load inside torch's C++ to come out of it, and let none go in again."""
    global _exiting
    with _native:
        _exiting = True


def when_loaded(dtype: torch.dtype, callback: Callable[[Any], None]) -> None:
    """Call `callback(operators)` once `dtype`'s library is loaded: now if it is, else on the
    thread that loads it, right after (never if it fails to load)."""
    with _callbacks_lock:
        if dtype not in _loaded:
            _when_loaded.setdefault(dtype, []).append(callback)
            return
    _run_callback(callback, _loaded[dtype])


def _run_callback(callback: Callable[[Any], None], ops: Any) -> None:
    try:
        callback(ops)
    except Exception:  # a loader thread must not die of it, nor the engine stop
        logger.exception("after loading the CPU kernels")


def start_loading(cache_dir: Path, dtype: torch.dtype) -> None:
    """Load `dtype`'s library (building first if needed) on a thread of its own, once per
    process."""
    with _start_lock:  # not _lock: a build holds that for its ~25 s, and this must not wait
        if dtype in _loaded or dtype in _loaders or not supported(dtype):
            return
        loader = threading.Thread(target=load, args=(cache_dir, dtype), name="cpu-kernel-build")
        loader.daemon = True
        _loaders[dtype] = loader
        loader.start()


def wait(timeout: float | None = None) -> bool:
    """Block until the started loads end; whether any was started and all of them loaded."""
    for loader in list(_loaders.values()):
        loader.join(timeout)
    return bool(_loaders) and all(dtype in _loaded for dtype in _loaders)


def main() -> None:
    """Build every library the host can run into the default cache dir now (`make setup`
    does, so that the first start need not)."""
    from blockserve.model.loader import default_cache_dir

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for dtype, library in LIBRARIES.items():
        if supported(dtype):
            load(default_cache_dir(), dtype)
        else:
            needs = " or ".join(" ".join(target.needs) for target in library.targets)
            logger.info(
                "CPU kernels %s: not for this host (needs %s, and g++)", library.name, needs
            )


def loaded(dtype: torch.dtype) -> bool:
    """Whether `dtype`'s library is loaded (switched in or not)."""
    return dtype in _loaded


def loaded_isa(dtype: torch.dtype) -> str | None:
    """The instruction set of `dtype`'s loaded build (`avx512`, `avx2`, ...), or None."""
    return _isas.get(dtype)


def _ops_for(x: torch.Tensor) -> Any:
    """The loaded operators for tensors like `x` (head dimension last), or None."""
    if not serves(x.device, x.dtype, x.shape[-1]):
        return None
    return _loaded.get(x.dtype)


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
    return _loaded.get(hidden.dtype)


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
    ops = _loaded.get(x.dtype)
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
    ops = _loaded.get(key.dtype)
    return None if ops is None else ops.write_kv_


def tile_linear(x: torch.Tensor) -> Callable[..., torch.Tensor] | None:
    """Our product of few rows on AMX tiles (cpu_linear_bf16.cpp) for rows like `x`, or None:
    bf16 on a CPU with AMX-BF16 once the library is loaded, and not switched off."""
    if _tile_ops is None or not (_tiles_wanted and _products_enabled) or x.dtype != torch.bfloat16:
        return None
    return _tile_ops.tile_linear if x.device.type == "cpu" else None


def vector_linear(x: torch.Tensor, isa: str | None) -> Callable[..., torch.Tensor] | None:
    """Our float32 product of few rows (cpu_linear_f32.cpp) for rows like `x` over a weight
    packed by the `isa` build (`vector_pack`: each build packs for its own vector width), or
    None: the float32 library's `isa` build loaded, at most `VECTOR_MAX_ROWS` rows, and not
    switched off (`enable(products=False)`)."""
    ops = _loaded.get(torch.float32)
    if (
        ops is None
        or not _products_enabled
        or x.dtype != torch.float32
        or x.device.type != "cpu"
        or isa is None
        or _isas[torch.float32] != isa
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
    ops = _loaded.get(torch.bfloat16)
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
