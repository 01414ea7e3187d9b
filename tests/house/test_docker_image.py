"""The Docker image is the engine: a wheel built from exactly the files the Dockerfile copies
carries the kernels' sources, and a kernel library it names runs (Docker itself is not
available on the test hosts, so the image's own build is not run here)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from blockserve.kernels.build import can_build

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow  # a wheel build and a kernel library loaded in a fresh process

# Run from an unpacked wheel, in a process that cannot see the checkout: the sources it
# finds must be the wheel's, and the library it loads the one named by their bytes.
KERNEL_FROM_THE_WHEEL = """
import sys
from pathlib import Path

sys.path.insert(0, sys.argv[1])  # the unpacked wheel, ahead of the checkout's editable install

import torch

import blockserve
from blockserve.kernels.build import library_path
from blockserve.kernels.loader import KernelLoader
from blockserve.kernels.sources import source_dir

site, cache = Path(sys.argv[1]), Path(sys.argv[2])
assert Path(blockserve.__file__).is_relative_to(site), blockserve.__file__
assert source_dir("cpu").is_relative_to(site), source_dir("cpu")
ops = KernelLoader().load(cache, torch.float32)
assert ops is not None
torch.manual_seed(0)
weight, x = torch.randn(64, 32), torch.randn(3, 32)
out = ops.vector_linear(x, ops.vector_pack(weight), None)
torch.testing.assert_close(out, x @ weight.T, rtol=1e-5, atol=1e-5)
print(library_path(cache, torch.float32).name)
"""


def dockerfile_copies() -> list[str]:
    """The sources of the Dockerfile's COPY lines (relative to the build context)."""
    sources = []
    for line in (ROOT / "Dockerfile").read_text().splitlines():
        words = line.split()
        if words[:1] == ["COPY"]:
            assert not any(word.startswith("--") for word in words), line
            sources.extend(words[1:-1])
    return sources


def test_the_dockerfile_copies_what_the_wheel_is_built_from() -> None:
    assert dockerfile_copies() == ["pyproject.toml", "setup.py", "README.md", "blockserve", "csrc"]


@pytest.mark.skipif(
    not can_build(torch.float32), reason="needs an x86 CPU with AVX2 and FMA, and g++"
)
def test_a_wheel_of_the_copied_files_runs_a_cpu_kernel(
    tmp_path: Path, cpu_kernels_dir: Path
) -> None:
    """The wheel holds every kernel source byte for byte (the library it names is the one the
    session built from the checkout's csrc/, found in the cache, not rebuilt), and that library
    loads and multiplies as torch does."""
    context = tmp_path / "context"
    context.mkdir()
    for name in dockerfile_copies():
        source = ROOT / name
        if source.is_dir():
            shutil.copytree(source, context / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(source, context / name)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "--wheel-dir",
            str(tmp_path / "dist"),
            str(context),
        ],
        check=True,
        cwd=tmp_path,
        timeout=300,
    )
    (wheel,) = (tmp_path / "dist").glob("blockserve-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        archive.extractall(tmp_path / "site")
    shipped = {Path(name).relative_to("blockserve") for name in names if "/csrc/" in name}
    in_checkout = {
        path.relative_to(ROOT)
        for kind in ("cpu", "cuda")
        for path in (ROOT / "csrc" / kind).rglob("*")
        if path.is_file()
    }
    assert shipped == in_checkout
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "BLOCKSERVE_CACHE_DIR")}
    ran = subprocess.run(
        [
            sys.executable,
            "-I",
            "-c",
            KERNEL_FROM_THE_WHEEL,
            str(tmp_path / "site"),
            str(cpu_kernels_dir),
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=300,
    )
    assert ran.returncode == 0, ran.stderr
    assert (cpu_kernels_dir / "cpu_kernels" / ran.stdout.strip()).is_file()
