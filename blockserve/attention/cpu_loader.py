"""Building our CPU kernel libraries (cpu_build.py) on a thread and loading them into torch:
the operators of each dtype's loaded build, and what waits for them.

A build (~25 s, once per host, torch and sources) runs on a thread of its own when an engine
starts, so start-up does not wait for it; later starts load the library from the cache dir in
a fraction of a second. `make setup` builds every library the host can run (`main`). That
thread is a daemon (exit never waits for a build), so it must not be inside torch's C++ when
the interpreter shuts down: a thread stopped there aborts the process. At exit, `_at_exit`
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

from blockserve.attention.cpu_build import LIBRARIES, build, library_path, supported, target_for

logger = logging.getLogger(__name__)

_lock = threading.Lock()  # one load (and build) at a time
_start_lock = threading.Lock()
_loaded: dict[torch.dtype, Any] = {}  # dtype → its operators (the torch.ops namespace)
_isas: dict[torch.dtype, str] = {}  # dtype → the instruction set of its loaded build
_loaders: dict[torch.dtype, threading.Thread] = {}
_tile_ops: Any = None  # the bf16 operators, once loaded where the CPU has AMX-BF16
_callbacks_lock = threading.Lock()
_when_loaded: dict[torch.dtype, list[Callable[[Any], None]]] = {}
_native = threading.RLock()  # held while a load runs torch's C++: the library, its callbacks
_exiting = False  # the interpreter is shutting down: no load starts its C++ any more


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
    from blockserve.config import default_cache_dir

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


def ops(dtype: torch.dtype) -> Any:
    """`dtype`'s loaded operators (a torch.ops namespace), or None."""
    return _loaded.get(dtype)


def tile_ops() -> Any:
    """The bf16 operators where they are loaded and the CPU has AMX-BF16, else None."""
    return _tile_ops
