"""Without a CUDA device, Triton kernels run under its interpreter (set before they are
imported: `triton.jit` reads it when decorating). The csrc emulator is built once a session."""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def emulator(tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    """csrc/cuda/kernels.cu built by g++ with the fiber emulator (cuda_emulation/)."""
    from tests.attention.cuda_emulation import build_emulator

    return build_emulator(Path(tmp_path_factory.mktemp("emulator")))
