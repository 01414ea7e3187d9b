"""The map of the tree: docs/architecture.md names every package and top-level module, and
each package's docstring names every module in it (the file index lives beside the files)."""

from __future__ import annotations

import ast
from pathlib import Path

import blockserve

PACKAGE = Path(blockserve.__file__).parent
MAP = (PACKAGE.parent / "docs" / "architecture.md").read_text()


def packages() -> list[Path]:
    return sorted(p.parent for p in PACKAGE.rglob("__init__.py") if p.parent != PACKAGE)


def test_every_package_and_top_level_module_is_on_the_map() -> None:
    names = [f"{p.relative_to(PACKAGE)}/" for p in packages() if p.parent == PACKAGE]
    names += [p.name for p in sorted(PACKAGE.glob("*.py")) if p.name != "__init__.py"]
    assert len(names) > 20
    assert [name for name in names if f"`{name}`" not in MAP] == []


def test_each_package_docstring_names_its_modules() -> None:
    """Every module and subpackage of a package appears in its __init__'s docstring."""
    missing = []
    for package in packages():
        doc = ast.get_docstring(ast.parse((package / "__init__.py").read_text())) or ""
        entries = [p.name for p in package.glob("*.py") if p.name != "__init__.py"]
        entries += [f"{p.name}/" for p in package.iterdir() if (p / "__init__.py").exists()]
        missing += [f"{package.name}/{e}" for e in sorted(entries) if e not in doc]
    assert missing == []
