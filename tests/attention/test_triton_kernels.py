"""The Triton kernels compile for sm_90 (Hopper) with the launch parameters the backend uses:
no GPU needed, so CI checks what the interpreter cannot — that the code generator accepts the
kernels, that 16-bit attention runs on tensor cores with its K/V loads pipelined and no
register spills, and that shared memory fits an H100/H200 block."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
SM90_SHARED_LIMIT = 227 * 1024  # the largest shared-memory allocation of one sm_90 block


@pytest.fixture(scope="module")
def reports() -> dict[str, dict[str, Any]]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run(
        [sys.executable, "-W", "ignore", "-m", "tests.attention.aot_compile"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    lines = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    return {report["kernel"]: report for report in lines}


@pytest.mark.slow
def test_every_kernel_compiles_and_fits(reports: dict[str, dict[str, Any]]) -> None:
    """20 attention variants (5 dtype/head shapes x decode/prefill tiles x split or not),
    2 merges and 2 cache writers compile; each fits sm_90's shared memory."""
    kinds = [name.split("-")[0] for name in reports]
    assert (kinds.count("attention"), kinds.count("merge"), kinds.count("cache")) == (20, 2, 2)
    for name, report in reports.items():
        assert report["shared_bytes"] <= SM90_SHARED_LIMIT, name


@pytest.mark.slow
def test_16_bit_attention_uses_tensor_cores_pipelined_without_spills(
    reports: dict[str, dict[str, Any]],
) -> None:
    """bf16/fp16 attention: mma instructions, asynchronous K/V copies, no stack (spills)."""
    half = {n: r for n, r in reports.items() if n.startswith("attention") and r["dtype"] != "fp32"}
    assert len(half) == 12
    for name, report in half.items():
        assert report["tensor_cores"], name
        assert report["async_copies"], name
        assert report["stack_bytes"] == 0, name
