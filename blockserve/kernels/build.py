"""Our CPU kernel libraries: which exist, what each is built from (csrc/cpu) and for, whether
this host can build and run it, and the g++ build, written whole under `<cache dir>/cpu_kernels`
and named by its build, the torch install and a hash of its sources and flags. A process that
exits mid-build leaves neither a compiler nor a scratch directory behind."""

from __future__ import annotations

import atexit
import functools
import hashlib
import os
import shutil
import signal
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from blockserve.kernels.sources import source_dir

COMMON_FLAGS = ("-O3", "-std=c++20", "-shared", "-fPIC", "-fopenmp", "-w")


@dataclass(frozen=True, slots=True)
class Target:
    """An instruction set one of our libraries is built for."""

    name: str  # the built file's prefix
    isa: str  # its name in logs and tests
    flags: tuple[str, ...]  # g++'s, for it
    needs: tuple[str, ...]  # torch.cpu.get_capabilities() flags the host must have
    namespace: str  # of the build's operators under torch.ops


@dataclass(frozen=True, slots=True)
class Library:
    """One of our kernel libraries: what it serves, what it is built from, what for."""

    name: str
    dtype: torch.dtype
    sources: tuple[str, ...]  # files in csrc/cpu; .cpp ones are compiled
    targets: tuple[Target, ...]  # the widest first: a host runs the first it can

    def paths(self) -> tuple[Path, ...]:
        return tuple(source_dir("cpu") / name for name in self.sources)


F32_FLAGS = ("-mavx2", "-mfma", "-ffp-contract=off")
BF16_TARGET = Target(
    name="bf16",
    isa="avx512-bf16",
    # AMX is used only where the CPU has it
    flags=("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16", "-mfma",
           "-mf16c", "-mavx512vnni", "-mamx-tile", "-mamx-bf16"),
    needs=("avx512_bf16", "avx512_vnni", "f16c"),
    namespace="blockserve_cpu",
)  # fmt: skip
# The f32 attention and product kernels compute on sixteen lanes where the CPU has AVX-512F.
F32_TARGETS = (
    Target(
        name="f32_avx512",
        isa="avx512",
        flags=(*F32_FLAGS, "-mavx512f", "-DBLOCKSERVE_F32_OPS=blockserve_cpu_f32_avx512"),
        needs=("avx2", "fma3", "avx512_f"),
        namespace="blockserve_cpu_f32_avx512",
    ),
    Target(
        name="f32",
        isa="avx2",
        flags=(*F32_FLAGS, "-DBLOCKSERVE_F32_OPS=blockserve_cpu_f32"),
        needs=("avx2", "fma3"),
        namespace="blockserve_cpu_f32",
    ),
)
LIBRARIES = {
    library.dtype: library
    for library in (
        Library(
            name="bf16",
            dtype=torch.bfloat16,
            sources=("attention_bf16.cpp", "layer_ops_bf16.cpp", "linear_bf16.cpp",
                     "linear_gguf.cpp", "linear_vectors_bf16.cpp", "linear_f16.cpp",
                     "dot_rates.cpp", "bf16.h", "exp2.h", "amx.h", "attention.h", "tasks.h",
                     "layer_ops.h", "lora.h"),
            targets=(BF16_TARGET,),
        ),
        Library(
            name="f32",
            dtype=torch.float32,
            sources=("attention_f32.cpp", "layer_ops_f32.cpp", "linear_f32.cpp", "f32.h",
                     "exp2.h", "attention.h", "tasks.h", "layer_ops.h", "lora.h"),
            targets=F32_TARGETS,
        ),
    )
}  # fmt: skip


def runnable(dtype: torch.dtype) -> tuple[Target, ...]:
    """`dtype`'s builds this CPU can run, the widest first (none on other machines)."""
    if dtype not in LIBRARIES:
        return ()
    flags = torch.cpu.get_capabilities()
    return tuple(
        target
        for target in LIBRARIES[dtype].targets
        if all(flags.get(flag) for flag in target.needs)
    )


def target_for(dtype: torch.dtype, isa: str | None = None) -> Target:
    """The build of `dtype`'s library to run here: the widest the CPU can run, or the one
    named `isa` (tests and benchmarks compare them); ValueError if the CPU cannot run it."""
    for target in runnable(dtype):
        if isa is None or target.isa == isa:
            return target
    raise ValueError(
        f"no {isa + ' ' if isa else ''}build of the {dtype} CPU kernels runs on this CPU"
    )


def can_build(dtype: torch.dtype) -> bool:
    """Whether `dtype`'s library can run here: an x86 CPU with the instructions of one of its
    builds, a g++ to build with, and not switched off by `BLOCKSERVE_CPU_ATTENTION_KERNEL=0`
    (to compare against torch's kernels)."""
    if os.environ.get("BLOCKSERVE_CPU_ATTENTION_KERNEL", "1") == "0":
        return False
    return bool(runnable(dtype)) and shutil.which("g++") is not None


def library_path(cache_dir: Path, dtype: torch.dtype, isa: str | None = None) -> Path:
    """`<build>-<torch install>-<sources and flags>.so` (`build`: bf16, f32_avx512, f32):
    each torch install (several venvs may share a cache dir) keeps its own build, and a new
    source replaces only its own."""
    library, target = LIBRARIES[dtype], target_for(dtype, isa)
    torch_lib = Path(torch.__file__).parent / "lib"
    install = digest(torch.__version__, str(torch_lib))
    flags = " ".join(COMMON_FLAGS + target.flags)
    source = digest(*(path.read_bytes() for path in library.paths()), flags)
    return cache_dir / "cpu_kernels" / f"{target.name}-{install}-{source}.so"


def digest(*parts: str | bytes) -> str:
    hasher = hashlib.sha256()
    for part in parts:
        hasher.update(part if isinstance(part, bytes) else part.encode())
        hasher.update(b"\0")
    return hasher.hexdigest()[:12]


def build(target: Path, dtype: torch.dtype, isa: str | None = None) -> None:
    """Compile `dtype`'s library, the build `target_for(dtype, isa)`, into `target` (written
    whole: another process may be loading it)."""
    from torch.utils.cpp_extension import include_paths

    library, instructions = LIBRARIES[dtype], target_for(dtype, isa)
    torch_lib = Path(torch.__file__).parent / "lib"
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    target.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(dir=target.parent, prefix=".build-"))
    # At the lowest priority: it runs while the engine starts and serves.
    nice = ["nice", "-n", "19"] if shutil.which("nice") else []
    command = [
        *nice, "g++", *COMMON_FLAGS, *instructions.flags, f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
        *(f"-I{path}" for path in include_paths()),
        *(str(path) for path in library.paths() if path.suffix == ".cpp"),
        f"-L{torch_lib}", f"-Wl,-rpath,{torch_lib}", "-lc10", "-ltorch_cpu",
        "-o", str(scratch / target.name),
    ]  # fmt: skip
    process = subprocess.Popen(  # its own process group: g++ runs cc1plus and ld under it
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    stop = functools.partial(_stop, process, scratch)
    atexit.register(stop)  # a process that exits mid-build (a server stopped while starting)
    try:
        _, errors = process.communicate(timeout=600)
        if process.returncode != 0:
            raise subprocess.CalledProcessError(process.returncode, command, stderr=errors)
        os.replace(scratch / target.name, target)
        install = target.name.split("-")[1]
        for stale in target.parent.glob(f"{instructions.name}-{install}-*.so"):  # older source
            if stale != target:
                stale.unlink(missing_ok=True)
    finally:
        stop()
        atexit.unregister(stop)


def _stop(process: subprocess.Popen, scratch: Path) -> None:
    """End a build (if it still runs) and remove its scratch directory."""
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    shutil.rmtree(scratch, ignore_errors=True)
