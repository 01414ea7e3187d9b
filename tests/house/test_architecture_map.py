"""docs/architecture.md's module map names every module of the package."""

from __future__ import annotations

from pathlib import Path

import blockserve

PACKAGE = Path(blockserve.__file__).parent
MAP = (PACKAGE.parent / "docs" / "architecture.md").read_text()


def test_every_module_is_on_the_map() -> None:
    """Each blockserve/**/*.py but the package __init__s appears in the map by file name."""
    modules = sorted(
        str(path.relative_to(PACKAGE))
        for path in PACKAGE.rglob("*.py")
        if path.name != "__init__.py"
    )
    assert modules
    assert [m for m in modules if Path(m).name not in MAP] == []
