"""csrc/ compiles with nvcc for sm_90: a syntax and type check that needs no GPU."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from tests.attention.cuda_emulation import cuda_include_dir

CSRC = Path(__file__).resolve().parents[2] / "csrc" / "cuda"
NVCC = shutil.which("nvcc")


@pytest.mark.slow
@pytest.mark.skipif(NVCC is None, reason="nvcc is not installed on this machine")
def test_kernels_compile_to_ptx_for_sm90(tmp_path: Path) -> None:
    """kernels.cu compiles to PTX for sm_90 and defines its three kernels for every dtype (the
    decode kernel for 4 lane widths x 2 head-group sizes each)."""
    assert NVCC is not None
    ptx = tmp_path / "kernels.ptx"
    result = subprocess.run(
        [NVCC, "-arch=sm_90", "--ptx", "-I", str(CSRC), str(CSRC / "kernels.cu"), "-o", str(ptx)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    text = ptx.read_text()
    assert ".target sm_90" in text
    entries = [line for line in text.splitlines() if line.startswith(".visible .entry")]
    names = " ".join(entries)
    assert len(entries) == 30
    assert names.count("reshape_and_cache_kernel") == 3  # float, half, bfloat16
    assert names.count("merge_decode_splits_kernel") == 3
    assert names.count("paged_decode_kernel") == 24  # x (1, 2, 4, 8 dims) x (4, 8 heads)


@pytest.mark.slow
@pytest.mark.skipif(
    shutil.which("g++") is None or cuda_include_dir() is None,
    reason="needs g++ and the CUDA runtime headers, absent on this machine",
)
def test_bindings_type_check_against_torch_headers(tmp_path: Path) -> None:
    """bindings.cpp compiles (syntax and types) against the installed torch's C++ API.

    A CPU-only torch wheel ships c10/cuda's headers but not the one its CMake build generates
    (cuda_cmake_macros.h); a stand-in defining its one macro takes its place.
    """
    import sysconfig

    from torch.utils.cpp_extension import include_paths

    generated = tmp_path / "c10" / "cuda" / "impl" / "cuda_cmake_macros.h"
    generated.parent.mkdir(parents=True)
    generated.write_text("#define C10_CUDA_BUILD_SHARED_LIBS\n")
    includes = [*include_paths(), str(tmp_path), sysconfig.get_paths()["include"]]
    includes += [str(cuda_include_dir()), str(CSRC)]
    result = subprocess.run(
        ["g++", "-std=c++20", "-fsyntax-only", "-DTORCH_EXTENSION_NAME=blockserve_cuda"]
        + [f"-I{path}" for path in includes]
        + [str(CSRC / "bindings.cpp")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
