"""Shared by the benchmark scripts: print the JSON result and keep a copy, stamped with the
CPU's vector extensions (bf16 matmul is ~100x slower on an AVX2-only host than with
AVX512-BF16, so a figure means little without them)."""

from __future__ import annotations

import argparse
import json
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")


def cpu_flags() -> list[str]:
    """Which of CPU_FLAGS this host's processor has (empty where /proc/cpuinfo is absent)."""
    try:
        words = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return []
    return [flag for flag in CPU_FLAGS if flag in words]


def emit(results: dict[str, Any], out: Path | None) -> None:
    """Print `results` as JSON, with the host's CPU flags, torch's ISA level and threads, and
    when `out` is given write it there too."""
    import torch

    host = {
        "cpu_flags": cpu_flags(),
        "isa": torch.backends.cpu.get_cpu_capability(),
        "threads": torch.get_num_threads(),
    }
    text = json.dumps({**results, **host}, indent=2)
    print(text)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n")


def run_sections(
    doc: str | None,
    sections: dict[str, Callable[[Path], dict[str, Any]]],
    benchmark: str,
    server_args: list[str],
) -> None:
    """A benchmark of named sections, each given a folder for its servers' logs: run those
    `--sections` asks for (default all), then emit their results to `--out`."""
    parser = argparse.ArgumentParser(description=(doc or "").split("\n")[0])
    parser.add_argument("--sections", nargs="+", choices=list(sections), default=list(sections))
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as logs:
        results = {name: sections[name](Path(logs)) for name in args.sections}
    emit({"benchmark": benchmark, "server_args": server_args, **results}, args.out)
