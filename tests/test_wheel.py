"""A wheel built from this tree carries both kernel source trees (csrc/cpu, csrc/cuda) and,
installed outside the checkout, finds its sources, loads its CPU kernels and runs one."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from blockserve.kernels.build import can_build

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = """
import sys, torch
from pathlib import Path
import blockserve
from blockserve.kernels import KernelLoader
from blockserve.kernels.sources import source_dir
x = torch.randn(3, 64, generator=torch.Generator().manual_seed(1))
weight = torch.rand(64, generator=torch.Generator().manual_seed(2))
ops = KernelLoader().load(Path(sys.argv[1]), torch.float32)
expected = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * weight
got = ops.rms_norm(x, weight, 1e-5)
print(blockserve.__file__, source_dir("cpu"), source_dir("cuda"))
print((got - expected).abs().max().item())
"""


@pytest.mark.slow
@pytest.mark.skipif(
    not can_build(torch.float32), reason="needs an x86 CPU with AVX2 and FMA, and g++"
)
def test_an_installed_wheel_builds_and_runs_its_kernels(
    tmp_path: Path, cpu_kernels_dir: Path
) -> None:
    """Built without build isolation (offline) from a copy of the tree, installed into a
    scratch directory, run from outside the checkout. Its library is the one the session
    built from the same sources into `cpu_kernels_dir` (named by a hash of them, so found
    only if the wheel's sources are those bytes): a g++ build is ~30 s."""
    source = tmp_path / "src"
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info")
    for name in ("blockserve", "csrc"):
        shutil.copytree(ROOT / name, source / name, ignore=ignore)
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(ROOT / name, source / name)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run(
        [*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", tmp_path / "dist", source],
        check=True, cwd=tmp_path,
    )  # fmt: skip
    (wheel,) = (tmp_path / "dist").glob("blockserve-*.whl")
    site = tmp_path / "site"
    subprocess.run([*pip, "install", "--no-deps", "--target", site, wheel], check=True)
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(cpu_kernels_dir)],
        capture_output=True, text=True, cwd=tmp_path, env={"PYTHONPATH": str(site), "PATH": ""},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    paths, error = done.stdout.splitlines()
    package, cpu, cuda = paths.split()
    assert Path(package) == site / "blockserve" / "__init__.py"
    assert (Path(cpu), Path(cuda)) == (site / "blockserve/csrc/cpu", site / "blockserve/csrc/cuda")
    assert float(error) < 1e-5
