"""Fixtures shared across the suite: tiny model directories, built once per session."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.tiny_models import save_tiny_model

    return save_tiny_model(tmp_path_factory.mktemp("tiny-llama"), "llama")


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.tiny_models import save_tiny_model

    return save_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"), "qwen2")


@pytest.fixture(scope="session")
def cpu_kernels_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A cache dir every build of a CPU kernel library the host can run was built into (once
    a session: ~20 s each). Before the builds it held, for each, an older source's library
    for this torch install, which its build replaces, and another install's, which they
    leave (tests/attention/test_cpu_kernel.py checks both)."""
    from blockserve.attention import cpu_build, cpu_kernels

    directory = tmp_path_factory.mktemp("kernel-cache")
    (directory / "cpu_kernels").mkdir()
    (directory / "cpu_kernels" / "bf16-000000000000-000000000000.so").touch()
    for dtype in cpu_kernels.LIBRARIES:
        if not cpu_kernels.supported(dtype):
            continue
        for build in cpu_build.runnable(dtype):  # f32: AVX2's too, on an AVX-512 host
            target = cpu_build.library_path(directory, dtype, build.isa)
            install_prefix = target.name.rsplit("-", 1)[0]
            (target.parent / f"{install_prefix}-000000000000.so").touch()
            cpu_build.build(target, dtype, build.isa)
            assert target.is_file()
    return directory
