"""Fixtures shared across the suite: tiny model directories and adapters, built once per
session."""

from __future__ import annotations

import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest


def pytest_configure(config: pytest.Config) -> None:
    """The suite's engines (and the servers it starts) run a fixed thread count: an adapted
    one would follow the load of the suite's own servers, and float32 sums differ in their
    last bits between counts (tests/test_cpu_threads.py tests the adapting). Without a CUDA
    device, Triton kernels run under its interpreter (set before any is imported: `triton.jit`
    reads it when decorating)."""
    import torch

    os.environ.setdefault("OMP_NUM_THREADS", str(torch.get_num_threads()))
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A test on our built CPU kernels is slow wherever it sits: the session builds every
    library the host can run before the first one (cpu_kernels_dir, ~20 s a build)."""
    for item in items:
        if "cpu_kernels_dir" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.tiny_models import save_tiny_model

    return save_tiny_model(tmp_path_factory.mktemp("tiny-llama"), "llama")


@pytest.fixture(scope="session")
def adapters(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two PEFT adapters over the tiny llama (tests/lora/adapters.py): `every`, rank 4 on all
    seven projections; `qv`, rank-8 rsLoRA on q and v."""
    from tests.lora.adapters import save_adapter

    root = tmp_path_factory.mktemp("adapters")
    return {
        "every": save_adapter(tiny_llama_dir, root / "every", seed=1),
        "qv": save_adapter(
            tiny_llama_dir, root / "qv", seed=2, rank=8, modules=["q_proj", "v_proj"], rslora=True
        ),
    }


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.tiny_models import save_tiny_model

    return save_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"), "qwen2")


@pytest.fixture(scope="session")
def cpu_kernels_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A cache dir holding every build of a CPU kernel library the host can run (~20-40 s a
    build). A build `make setup` already made in the default cache dir (named by its sources,
    flags and torch install, so the same bytes) is copied; the others are built here, and at
    least one is: before its build, the dir held an older source's library for this torch
    install, which the build replaces, and another install's, which it leaves
    (tests/kernels/test_cpu_kernel.py checks both). Under pytest-xdist (PYTEST_WORKERS) the
    first worker to need it makes it for all: the others wait on a file lock, then read it."""
    from filelock import FileLock

    base = tmp_path_factory.getbasetemp()
    shared = base.parent if "PYTEST_XDIST_WORKER" in os.environ else base
    directory = shared / "kernel-cache"
    with FileLock(shared / "kernel-cache.lock"):
        if not (directory / "made").is_file():
            shutil.rmtree(directory, ignore_errors=True)  # a worker that died making it
            _make_kernel_cache(directory)
            (directory / "made").touch()
    return directory


def _make_kernel_cache(directory: Path) -> None:
    """cpu_kernels_dir's contents, made in `directory`."""
    from blockserve.config import default_cache_dir
    from blockserve.kernels import build

    (directory / "cpu_kernels").mkdir(parents=True)
    (directory / "cpu_kernels" / "bf16-000000000000-000000000000.so").touch()
    wanted = [
        (build.library_path(directory, dtype, target.isa), dtype, target.isa)
        for dtype in build.LIBRARIES
        if build.can_build(dtype)
        for target in build.runnable(dtype)  # f32: AVX2's too, on an AVX-512 host
    ]
    made = default_cache_dir() / "cpu_kernels"
    builds = [job for job in wanted if not (made / job[0].name).is_file()] or wanted[-1:]
    for path, _, _ in wanted:
        if all(path != job[0] for job in builds):
            shutil.copy2(made / path.name, path)
    for path, _, _ in builds:
        install_prefix = path.name.rsplit("-", 1)[0]
        (path.parent / f"{install_prefix}-000000000000.so").touch()
    # One compiler per core: the builds are independent processes.
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        list(pool.map(lambda job: build.build(*job), builds))
    assert all(path.is_file() for path, _, _ in wanted)


@pytest.fixture(scope="session")
def kernels(cpu_kernels_dir: Path) -> Any:
    """Our CPU kernels with every library the host can run loaded (the widest build of each),
    all switched in; a test that switches some off or loads another build puts them back."""
    from blockserve.kernels import CpuKernels, build

    kernels = CpuKernels()
    for dtype in build.LIBRARIES:
        if build.can_build(dtype):
            assert kernels.loader.load(cpu_kernels_dir, dtype) is not None
    return kernels


@pytest.fixture
def redis_server(tmp_path: Path) -> Any:
    """A real Redis server process on a free port (blockserve/bench/redis_server.py)."""
    from blockserve.bench.redis_server import RedisServer

    server = RedisServer(tmp_path)
    yield server
    server.stop()
