"""What every benchmark shares: the host stamp (CPU flags, torch's ISA level, threads, torch's
version: a figure means little without them) and the JSON it prints and keeps."""

from __future__ import annotations

import json
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


def host_stamp() -> dict[str, Any]:
    import torch

    return {
        "cpu_flags": cpu_flags(),
        "isa": torch.backends.cpu.get_cpu_capability(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
    }


def emit(results: dict[str, Any], out: Path | None, to_stdout: bool = True) -> None:
    """`results` as JSON with the host stamp: written to `out` if given, and printed unless
    `to_stdout` is False (the commands that print a table instead)."""
    text = json.dumps({**results, **host_stamp()}, indent=2)
    if to_stdout:
        print(text)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n")


def table(headers: list[str], rows: list[list[Any]]) -> str:
    """A plain text table: a header line, a rule, then the rows, each column right-aligned
    to its widest cell."""
    cells = [headers, *[["-" if v is None else str(v) for v in row] for row in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = [
        "  ".join(cell.rjust(width) for cell, width in zip(row, widths, strict=True))
        for row in cells
    ]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(lines)


def percentile(values: list[float], q: float) -> float:
    """The `q`-quantile (0..1) of `values` by nearest rank; 0.0 for none."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]
