"""The csrc emulator, built once a session (Triton's interpreter is set by tests/conftest.py)."""

from __future__ import annotations

import ctypes
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def emulator(tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    """csrc/cuda/kernels.cu built by g++ with the fiber emulator (cuda_emulation/)."""
    from tests.attention.cuda_emulation import build_emulator

    return build_emulator(Path(tmp_path_factory.mktemp("emulator")))
