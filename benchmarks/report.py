"""Shared by the benchmark scripts: print the JSON result and keep a copy."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def emit(results: dict[str, Any], out: Path | None) -> None:
    """Print `results` as JSON and, when `out` is given, write it there too."""
    text = json.dumps(results, indent=2)
    print(text)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n")
