"""csrc/ compiles with nvcc for sm_90: a syntax and type check that needs no GPU."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

CSRC = Path(__file__).resolve().parents[2] / "csrc"
NVCC = shutil.which("nvcc")


@pytest.mark.skipif(NVCC is None, reason="nvcc is not installed on this machine")
def test_kernels_compile_to_ptx_for_sm90(tmp_path: Path) -> None:
    """kernels.cu compiles to PTX for sm_90 and defines both kernels for every dtype."""
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
    assert len(entries) == 6  # two kernels × float, half, bfloat16
    assert names.count("reshape_and_cache_kernel") == 3
    assert names.count("paged_decode_kernel") == 3
