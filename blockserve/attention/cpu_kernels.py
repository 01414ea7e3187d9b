"""Our CPU kernels (cpu_dense_bf16.cpp, cpu_layer_bf16.cpp), built with the host's g++ and
loaded into torch as the `blockserve_cpu` operators.

They serve models in bfloat16 on x86 CPUs with AVX512-BF16 (docs/architecture.md, "Our CPU
kernels"). The attention ones, for head dimension 64, serve the torch backend:
`dense_attention` for prefills one by one and each sequence's own blocks after a shared
prefix, 2-3x torch's fused kernel (docs/benchmarks.md, "Attention on the workloads' shapes");
`prefix_attention` for a shared prefix's common blocks, read in place; `paged_decode` for
decodes, reading each sequence's own blocks in place. The layer ones (`rms_norm`,
`add_rms_norm`, `rotary_`, `silu_and_mul`) serve an eager forward's elementwise math
(`layer_ops`). Elsewhere, or while they build, or if they cannot be built, torch's operators
serve: the result is the same up to rounding.

The build (~25 s, once per host, torch and sources) runs on a thread of its own when the engine
starts, so start-up does not wait for it; the library lands under `<cache dir>/cpu_kernels`,
named by a hash of what it was built from, and later starts load it in a fraction of a second.
"""

from __future__ import annotations

import atexit
import hashlib
import logging
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

SOURCES = tuple(
    Path(__file__).with_name(name)
    for name in ("cpu_dense_bf16.cpp", "cpu_layer_bf16.cpp", "cpu_bf16_common.h")
)
FLAGS = (
    "-O3", "-std=c++20", "-shared", "-fPIC", "-fopenmp", "-w",
    "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16", "-mfma",
)  # fmt: skip
HEAD_DIM = 64
MAX_DECODE_GROUP = 8  # query heads per KV head that paged_decode takes

_lock = threading.Lock()  # one load (and build) at a time
_start_lock = threading.Lock()
_op: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None
_paged: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None
_prefix: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None
_layer: Any = None  # the operator namespace, once loaded
_loader: threading.Thread | None = None
_builds: dict[subprocess.Popen, Path] = {}  # running compiles → their scratch directories
_enabled = True
_paged_enabled = True
_layer_enabled = True


def serves(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether a model on `device` in `dtype` with `head_dim` would use the kernel."""
    return device.type == "cpu" and dtype == torch.bfloat16 and head_dim == HEAD_DIM


def supported() -> bool:
    """An x86 CPU with AVX512-BF16, a g++ to build with, and not switched off by
    `BLOCKSERVE_CPU_ATTENTION_KERNEL=0` (to compare against torch's kernel)."""
    if os.environ.get("BLOCKSERVE_CPU_ATTENTION_KERNEL", "1") == "0":
        return False
    flags = torch.cpu.get_capabilities()
    return bool(flags.get("avx512_bf16")) and shutil.which("g++") is not None


def library_path(cache_dir: Path) -> Path:
    """`bf16-<torch install>-<sources and flags>.so`: each torch install (several venvs may
    share a cache dir) keeps its own build, and a new source replaces only its own."""
    torch_lib = Path(torch.__file__).parent / "lib"
    install = digest(torch.__version__, str(torch_lib))
    source = digest(*(path.read_bytes() for path in SOURCES), " ".join(FLAGS))
    return cache_dir / "cpu_kernels" / f"bf16-{install}-{source}.so"


def digest(*parts: str | bytes) -> str:
    hasher = hashlib.sha256()
    for part in parts:
        hasher.update(part if isinstance(part, bytes) else part.encode())
        hasher.update(b"\0")
    return hasher.hexdigest()[:12]


def build(target: Path) -> None:
    """Compile the kernel into `target` (written whole: another process may be loading it)."""
    from torch.utils.cpp_extension import include_paths

    torch_lib = Path(torch.__file__).parent / "lib"
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    target.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(dir=target.parent, prefix=".build-"))
    # At the lowest priority: it runs while the engine starts and serves.
    nice = ["nice", "-n", "19"] if shutil.which("nice") else []
    command = [
        *nice, "g++", *FLAGS, f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
        *(f"-I{path}" for path in include_paths()),
        *(str(path) for path in SOURCES if path.suffix == ".cpp"),
        f"-L{torch_lib}", f"-Wl,-rpath,{torch_lib}", "-lc10", "-ltorch_cpu",
        "-o", str(scratch / target.name),
    ]  # fmt: skip
    process = subprocess.Popen(  # its own process group: g++ runs cc1plus and ld under it
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    _builds[process] = scratch
    try:
        _, errors = process.communicate(timeout=600)
        if process.returncode != 0:
            raise subprocess.CalledProcessError(process.returncode, command, stderr=errors)
        os.replace(scratch / target.name, target)
        install = target.name.split("-")[1]
        for stale in target.parent.glob(f"*-{install}-*.so"):  # an older source's
            if stale != target:
                stale.unlink(missing_ok=True)
    finally:
        _stop(process, scratch)


def _stop(process: subprocess.Popen, scratch: Path) -> None:
    """End a build (if it still runs) and remove its scratch directory."""
    _builds.pop(process, None)
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    shutil.rmtree(scratch, ignore_errors=True)


@atexit.register
def _stop_builds() -> None:
    """A process that exits mid-build (a server stopped while starting) leaves nothing."""
    for process, scratch in list(_builds.items()):
        _stop(process, scratch)


def load(cache_dir: Path) -> Callable[..., tuple[torch.Tensor, torch.Tensor]] | None:
    """Build if needed and load the kernel; None (logged) where that fails. Blocking."""
    global _op, _paged, _prefix, _layer
    with _lock:
        if _op is not None:
            return _op
        target = library_path(cache_dir)
        started = time.perf_counter()
        try:
            if not target.exists():
                build(target)
            torch.ops.load_library(str(target))
        except (OSError, subprocess.SubprocessError) as error:
            detail = getattr(error, "stderr", "") or ""
            logger.warning("CPU kernels not built, torch's are used: %s %s", error, detail)
            return None
        _paged = torch.ops.blockserve_cpu.paged_decode
        _prefix = torch.ops.blockserve_cpu.prefix_attention
        _layer = torch.ops.blockserve_cpu
        _op = torch.ops.blockserve_cpu.dense_attention
        seconds = time.perf_counter() - started
        logger.info("CPU kernels ready in %.1f s (%s)", seconds, target)
        return _op


def start_loading(cache_dir: Path) -> None:
    """Load (building first if needed) on a thread of its own, once per process."""
    global _loader
    with _start_lock:  # not _lock: a build holds that for its ~25 s, and this must not wait
        if _op is not None or _loader is not None or not supported():
            return
        _loader = threading.Thread(target=load, args=(cache_dir,), name="cpu-kernel-build")
        _loader.daemon = True
        _loader.start()


def wait(timeout: float | None = None) -> bool:
    """Block until a started load ends; whether the kernel is in use."""
    thread = _loader
    if thread is not None:
        thread.join(timeout)
    return _op is not None


def main() -> None:
    """Build into the default cache dir now (`make setup` does, so that the first start need
    not)."""
    from blockserve.model.loader import default_cache_dir

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if not supported():
        logger.info("CPU kernels: not for this host (needs AVX512-BF16 and g++)")
        return
    load(default_cache_dir())


def dense_attention() -> Callable[..., tuple[torch.Tensor, torch.Tensor]] | None:
    """The loaded kernel, or None: never waits."""
    return _op if _enabled else None


def prefix_attention() -> Callable[..., tuple[torch.Tensor, torch.Tensor]] | None:
    """The loaded kernel for rows against whole blocks read in place (a shared prefix's common
    blocks), or None: switched with `dense_attention`."""
    return _prefix if _enabled else None


def paged_decode() -> Callable[..., tuple[torch.Tensor, torch.Tensor]] | None:
    """The loaded paged-decode kernel (decodes reading their keys in place), or None."""
    return _paged if _paged_enabled else None


def layer_ops(hidden: torch.Tensor, head_dim: int) -> Any:
    """The fused layer operators (`torch.ops.blockserve_cpu`) for an eager forward whose
    hidden states are `hidden`, or None where torch's operators serve: not loaded or switched
    off, not a model `serves` names, a hidden size not a multiple of 16."""
    if _layer is None or not _layer_enabled or hidden.shape[-1] % 16:
        return None
    return _layer if serves(hidden.device, hidden.dtype, head_dim) else None


def enable(on: bool, *, paged: bool | None = None, layer: bool | None = None) -> None:
    """Switch the loaded kernels out (torch serves) and back in: benchmarks compare the two.
    `paged` switches the paged decode alone, `layer` the fused layer operators (default: as
    `on`)."""
    global _enabled, _paged_enabled, _layer_enabled
    _enabled = on
    _paged_enabled = on if paged is None else paged
    _layer_enabled = on if layer is None else layer
