"""Where the kernels' sources are: `csrc/` of a checkout, or the copy a wheel carries as
`blockserve/csrc/` (setup.py puts it there). Both are built on the host at run time."""

from __future__ import annotations

from pathlib import Path

_PACKAGE = Path(__file__).resolve().parents[1]  # blockserve/


def source_dir(kind: str) -> Path:
    """`csrc/<kind>` (`cpu` or `cuda`) of this install."""
    installed = _PACKAGE / "csrc" / kind
    return installed if installed.is_dir() else _PACKAGE.parent / "csrc" / kind
