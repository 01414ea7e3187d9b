"""No module of blockserve keeps mutable state at module level: no `global` statement, and no
module-level name bound to a container or a lock unless it is a constant (UPPER_CASE, never
rebound). State lives in objects handed to whoever uses it."""

from __future__ import annotations

import ast
from pathlib import Path

import blockserve

PACKAGE = Path(blockserve.__file__).parent
MUTABLE_CALLS = {
    "dict", "list", "set", "defaultdict", "OrderedDict", "deque", "Counter", "Lock", "RLock",
    "Event", "Condition", "WeakValueDictionary", "WeakKeyDictionary", "WeakSet",
}  # fmt: skip
MUTABLE_DISPLAYS = (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp)


def mutable_state(source: str) -> list[str]:
    """What in `source` is module-level mutable state: `global` statements, and lower-case
    module-level names bound to a container or a lock."""
    tree = ast.parse(source)
    found = [
        f"global {', '.join(node.names)}" for node in ast.walk(tree) if isinstance(node, ast.Global)
    ]
    for node in tree.body:
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, value = [node.target], node.value
        else:
            continue
        names = [t.id for t in targets if isinstance(t, ast.Name)]
        if all(name.isupper() or name == "__all__" for name in names):
            continue
        call = value.func if isinstance(value, ast.Call) else None
        called = getattr(call, "attr", None) or getattr(call, "id", None)
        if isinstance(value, MUTABLE_DISPLAYS) or called in MUTABLE_CALLS:
            found.append(f"{', '.join(names)} = ...")
    return found


def test_no_module_keeps_mutable_state() -> None:
    found = {
        str(path.relative_to(PACKAGE)): state
        for path in sorted(PACKAGE.rglob("*.py"))
        if (state := mutable_state(path.read_text()))
    }
    assert found == {}


def test_the_check_finds_globals_containers_and_locks() -> None:
    source = (
        "import threading\n"
        "LIMITS = {'a': 1}\n"  # a constant
        "_cache = {}\n"
        "_lock = threading.Lock()\n"
        "_seen: list[int] = []\n"
        "name = 'x'\n"
        "def f():\n"
        "    global name\n"
    )
    assert mutable_state(source) == ["global name", "_cache = ...", "_lock = ...", "_seen = ..."]


def test_module_docstrings_state_their_contract_in_four_lines() -> None:
    """How a module works belongs to its classes' docstrings or the docs, not its header. A
    package's __init__ is the exception: its docstring is the package's file index."""
    long = {
        str(path.relative_to(PACKAGE)): lines
        for path in sorted(PACKAGE.rglob("*.py"))
        if path.name != "__init__.py"
        and (doc := ast.get_docstring(ast.parse(path.read_text()), clean=False))
        and (lines := doc.strip().count("\n") + 1) > 4
    }
    assert long == {}
