"""benchmarks/gpu_check.sh stays runnable while the tree changes around it: it can only be run
where a GPU is lent, so a renamed test file or a broken benchmark import would otherwise first
show on the device, costing its time."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"


def test_every_path_the_script_names_exists() -> None:
    """Each tests/... and benchmarks/... path in gpu_check.sh is a file or folder here (but
    benchmarks/results/..., where it writes)."""
    named = set(re.findall(r"\b((?:tests|benchmarks)/[\w/.]*\w)", SCRIPT.read_text()))
    paths = {p for p in named if not p.startswith("benchmarks/results")}
    assert {"tests/gpu", "benchmarks/bench_attention.py", "benchmarks/bench_gpu_engine.py"} <= paths
    assert sorted(p for p in paths if not (ROOT / p).exists()) == []


@pytest.mark.slow
def test_the_script_parses_and_the_benchmarks_import() -> None:
    """bash accepts the script; bench_attention.py and bench_gpu_engine.py import and answer
    --help."""
    assert subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True).returncode == 0
    for name, flag in (("bench_attention.py", "--sweep"), ("bench_gpu_engine.py", "--shapes")):
        bench = subprocess.run(
            [sys.executable, str(ROOT / "benchmarks" / name), "--help"],
            capture_output=True,
            text=True,
            cwd=ROOT,
            timeout=120,
        )
        assert bench.returncode == 0, bench.stderr
        assert flag in bench.stdout
