"""Shared by the benchmark scripts: the harness of `blockserve bench` (the host stamp and the
JSON out: blockserve/bench/harness.py), and sections run against started servers."""

from __future__ import annotations

import argparse
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from blockserve.bench.harness import cpu_flags, emit

__all__ = ["cpu_flags", "emit", "run_sections"]


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
