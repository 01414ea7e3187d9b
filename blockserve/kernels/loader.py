"""Loading our CPU kernel libraries into torch, building them first where needed, on a thread
of their own when an engine starts so that start-up does not wait; and what waits for them."""

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

from blockserve.kernels.build import LIBRARIES, build, can_build, library_path, target_for

logger = logging.getLogger(__name__)
KERNELS_NOT_BUILT = "CPU kernels not built, torch's are used"  # logged (benchmarks wait for it)

# torch's operator registry is one per process: a namespace registered twice (the same build
# from two paths) aborts it. Every loader registers under this lock, and only once.
REGISTRY_LOCK = threading.Lock()


def _registered(namespace: str) -> bool:
    """Whether a build's operators are already in torch (every library has this one)."""
    return hasattr(getattr(torch.ops, namespace), "dense_attention")


class KernelLoader:
    """The libraries loaded through this loader: each dtype's operators (a torch.ops
    namespace) and the instruction set of its build. torch holds a build's operators once a
    process: a loader finds them there if another loaded them.

    The loader thread is a daemon (exit never waits for a build), so it must not be inside
    torch's C++ when the interpreter shuts down: at exit the loader waits for it to come out and
    lets it not go back in.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()  # one load (and build) at a time
        self._start_lock = threading.Lock()
        self._callbacks_lock = threading.Lock()
        self._native = threading.RLock()  # held while a load runs torch's C++
        self._loaded: dict[torch.dtype, Any] = {}
        self._isas: dict[torch.dtype, str] = {}
        self._threads: dict[torch.dtype, threading.Thread] = {}
        self._when_loaded: dict[torch.dtype, list[Callable[[Any], None]]] = {}
        self._exiting = False  # the interpreter is shutting down: no load enters C++ again
        self.has_tiles = False  # the bf16 library is loaded and the CPU has AMX-BF16

    def __reduce__(self) -> tuple[type[KernelLoader], tuple[()]]:
        """Pickled as a fresh loader: what it loaded is this process's. (A compiled forward's
        cache key pickles the attention backend, and so its kernels.)"""
        return KernelLoader, ()

    def load(self, cache_dir: Path, dtype: torch.dtype, isa: str | None = None) -> Any:
        """Build if needed and load `dtype`'s library: its operators, or None (logged) where
        that fails or the interpreter is exiting. Blocking. The build loaded is the widest this
        CPU runs, or the one named `isa`, which then serves in place of the one loaded before
        (tests and benchmarks compare them; ValueError if the CPU cannot run it)."""
        with self._lock:
            if dtype in self._loaded and (isa is None or self._isas[dtype] == isa):
                return self._loaded[dtype]
            wanted = target_for(dtype, isa)
            started = time.perf_counter()
            try:
                with REGISTRY_LOCK:
                    with self._native:
                        if self._exiting:
                            return None
                        registered = _registered(wanted.namespace)
                    if not registered:
                        target = library_path(cache_dir, dtype, isa)
                        if not target.exists():
                            build(target, dtype, isa)
                        with self._native:
                            if self._exiting:
                                return None
                            torch.ops.load_library(str(target))
                        logger.info(
                            "CPU kernels ready in %.1f s (%s)",
                            time.perf_counter() - started,
                            target,
                        )
            except (OSError, subprocess.SubprocessError) as error:
                detail = getattr(error, "stderr", "") or ""
                logger.warning("%s: %s %s", KERNELS_NOT_BUILT, error, detail)
                with self._callbacks_lock:
                    self._when_loaded.pop(dtype, None)
                return None
            ops = getattr(torch.ops, wanted.namespace)
            self._loaded[dtype], self._isas[dtype] = ops, wanted.isa
            if dtype == torch.bfloat16:
                self.has_tiles = bool(ops.has_amx())
        with self._callbacks_lock:
            callbacks = self._when_loaded.pop(dtype, [])
        for callback in callbacks:
            with self._native:
                if self._exiting:
                    break
                _run_callback(callback, ops)
        return ops

    def start(self, cache_dir: Path, dtype: torch.dtype) -> None:
        """Load `dtype`'s library (building first if needed) on a thread of its own, once."""
        with self._start_lock:  # not _lock: a build holds that for its ~25 s
            if dtype in self._loaded or dtype in self._threads or not can_build(dtype):
                return
            if not self._threads:
                atexit.register(self._at_exit)
            thread = threading.Thread(
                target=self.load, args=(cache_dir, dtype), name="cpu-kernel-build", daemon=True
            )
            self._threads[dtype] = thread
            thread.start()

    def _at_exit(self) -> None:
        """Wait for a load inside torch's C++ to come out of it, and let none go in again."""
        with self._native:
            self._exiting = True

    def when_loaded(self, dtype: torch.dtype, callback: Callable[[Any], None]) -> None:
        """Call `callback(operators)` once `dtype`'s library is loaded: now if it is, else on
        the thread that loads it, right after (never if it fails to load)."""
        with self._callbacks_lock:
            if dtype not in self._loaded:
                self._when_loaded.setdefault(dtype, []).append(callback)
                return
        _run_callback(callback, self._loaded[dtype])

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the started loads end; whether any was started and all loaded."""
        for thread in list(self._threads.values()):
            thread.join(timeout)
        return bool(self._threads) and all(dtype in self._loaded for dtype in self._threads)

    def ops(self, dtype: torch.dtype) -> Any:
        """`dtype`'s loaded operators (a torch.ops namespace), or None."""
        return self._loaded.get(dtype)

    def isa(self, dtype: torch.dtype) -> str | None:
        """The instruction set of `dtype`'s loaded build (`avx512`, `avx2`, ...), or None."""
        return self._isas.get(dtype)


def _run_callback(callback: Callable[[Any], None], ops: Any) -> None:
    try:
        callback(ops)
    except Exception:  # a loader thread must not die of it, nor the engine stop
        logger.exception("after loading the CPU kernels")


def main() -> None:
    """Build every library the host can run into the default cache dir now (`make setup`
    does, so that the first start need not)."""
    from blockserve.config import default_cache_dir

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    loader = KernelLoader()
    for dtype, library in LIBRARIES.items():
        if can_build(dtype):
            loader.load(default_cache_dir(), dtype)
        else:
            needs = " or ".join(" ".join(target.needs) for target in library.targets)
            logger.info(
                "CPU kernels %s: not for this host (needs %s, and g++)", library.name, needs
            )
