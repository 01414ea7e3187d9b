"""Inside blockserve, a class built from more than three arguments is built with keywords: a
reader sees what each value is, and a field added or reordered cannot shift the others."""

from __future__ import annotations

import ast
from pathlib import Path

import blockserve

PACKAGE = Path(blockserve.__file__).parent


def positional_constructions(trees: dict[str, ast.Module]) -> list[str]:
    """`file:line Class` for each call of a class defined in `trees` given > 3 positionals."""
    classes = {n.name for t in trees.values() for n in ast.walk(t) if isinstance(n, ast.ClassDef)}
    found = []
    for name, tree in trees.items():
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call) or len(node.args) <= 3:
                continue
            func = node.func
            called = func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)
            if called in classes and not any(isinstance(a, ast.Starred) for a in node.args):
                found.append(f"{name}:{node.lineno} {called}")
    return found


def test_classes_of_more_than_three_arguments_are_built_with_keywords() -> None:
    trees = {
        str(path.relative_to(PACKAGE)): ast.parse(path.read_text())
        for path in sorted(PACKAGE.rglob("*.py"))
    }
    assert positional_constructions(trees) == []


def test_the_check_finds_a_positional_construction() -> None:
    tree = ast.parse("class P:\n    pass\nP(1, 2, 3)\nP(1, 2, 3, 4)\nP(1, 2, 3, d=4)\n")
    assert positional_constructions({"m.py": tree}) == ["m.py:4 P"]
