"""csrc/kernels.cu on the CPU: build the emulator library (emulate.cpp, which includes the
kernels) with g++ and load it with ctypes. See emulate.h for what emulation does and does not
check."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

HERE = Path(__file__).resolve().parent
CSRC = HERE.parents[2] / "csrc"


def cuda_include_dir() -> Path | None:
    """The CUDA headers' folder (types and fp16/bf16 conversions; no CUDA runtime is linked)."""
    from torch.utils.cpp_extension import CUDA_HOME

    include = Path(CUDA_HOME or "/usr/local/cuda") / "include"
    return include if (include / "cuda_runtime_api.h").is_file() else None


def missing_tools() -> str | None:
    """Why the emulator cannot be built here, or None."""
    if shutil.which("g++") is None:
        return "g++ is not installed on this machine"
    if cuda_include_dir() is None:
        return "the CUDA headers are not installed on this machine"
    return None


def build_emulator(out_dir: Path) -> ctypes.CDLL:
    library = out_dir / "libblockserve_emulated.so"
    command = [
        "g++",
        "-std=c++20",
        "-O2",
        "-shared",
        "-fPIC",
        "-DBLOCKSERVE_CPU_EMULATION",
        f"-I{cuda_include_dir()}",
        f"-I{CSRC}",
        f"-I{HERE}",
        str(HERE / "emulate.cpp"),
        "-o",
        str(library),
    ]
    subprocess.run(command, check=True, capture_output=True, text=True, timeout=300)
    lib = ctypes.CDLL(str(library))
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.emulated_reshape_and_cache.argtypes = [
        ctypes.c_int,
        *[ptr] * 5,
        i64,
        i64,
        i64,
        ctypes.c_int,
    ]
    lib.emulated_paged_decode.argtypes = [
        ctypes.c_int,
        *[ptr] * 6,
        *[ctypes.c_int] * 6,
        i64,
        i64,
        ctypes.c_float,
        ctypes.c_int,
    ]
    lib.emulated_decode_splits.argtypes = [*[ctypes.c_int] * 3, i64, ctypes.c_int]
    return lib
