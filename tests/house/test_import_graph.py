"""blockserve's modules import each other without a circle and never upward: every import,
module-level or inside a function, is an edge; `from package import module` is an edge to the
module alone (a package's __init__ runs first for any of its modules, and is no dependency of
its own). The layers, lowest first, are LAYERS below (docs/architecture.md draws them)."""

from __future__ import annotations

import ast
from pathlib import Path

import blockserve

PACKAGE = Path(blockserve.__file__).parent


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Module -> the blockserve modules it imports."""
    paths = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in paths.items():
        edges = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                edges.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module is not None:
                assert node.level == 0, f"{name}: relative import"
                modules = [f"{node.module}.{a.name}" for a in node.names]
                edges.update(m for m in modules if m in paths)
                if any(m not in paths for m in modules):
                    edges.add(node.module)
        graph[name] = {edge for edge in edges if edge in paths and edge != name}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (iterative Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            edge = next(edges, None)
            if edge is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
            elif edge not in index:
                index[edge] = low[edge] = len(index)
                stack.append(edge)
                on_stack.add(edge)
                work.append((edge, iter(sorted(graph[edge]))))
            elif edge in on_stack:
                low[node] = min(low[node], index[edge])
    return found


def test_no_module_imports_itself_through_others() -> None:
    """0 circles (there was one: attention's kernel loader reached model/loader.py for the
    cache directory, and model/llama.py imports attention's kernels)."""
    assert circles(import_graph()) == []


# Lowest first; a module may import its own layer and those below, never one above.
LAYERS = (
    ("errors",),
    ("options", "sampling_params"),
    ("grammar_limits", "platform", "cpu_threads", "multimodal"),
    ("core",),
    ("events", "kv_tiers"),
    ("config",),
    ("kernels",),
    ("sched", "attention", "grammar"),
    ("model",),
    ("lora",),
    ("runner",),
    ("engine", "blockserve"),  # the package's __init__ exposes the engine's LLM
    ("server",),
    ("cluster",),
    ("replay",),
    ("bench",),
    ("cli",),
)
RANK = {part: rank for rank, parts in enumerate(LAYERS) for part in parts}


def layer(module: str) -> str:
    """blockserve.core.hashing -> core; blockserve -> blockserve."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    return sorted(
        f"{module} -> {target}"
        for module, targets in graph.items()
        for target in targets
        if RANK[layer(module)] < RANK[layer(target)]
    )


def test_every_module_is_in_a_layer_and_no_import_goes_up() -> None:
    """Each top-level module or package has a layer, and each edge goes down or across."""
    graph = import_graph()
    assert {layer(module) for module in graph} <= set(RANK)
    assert upward_imports(graph) == []


def test_an_upward_import_is_found() -> None:
    """The check itself: core importing the engine is upward; the engine importing core,
    and sched importing attention (one layer), are not."""
    graph = {
        "blockserve.core.a": {"blockserve.engine.b"},
        "blockserve.engine.b": {"blockserve.core.a"},
        "blockserve.sched.c": {"blockserve.attention.d"},
    }
    assert upward_imports(graph) == ["blockserve.core.a -> blockserve.engine.b"]


def test_a_circle_is_found() -> None:
    """The check itself: a -> b -> c -> a is one circle; d, outside it, is not in it."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert circles(graph) == [["a", "b", "c"]]


def test_the_engine_enters_the_runner_through_start_alone() -> None:
    """Outside runner/, blockserve imports runner/start.py alone: start_runner hands the engine
    its runner and a RunnerInfo (no other entry, no reach into how the runner is built)."""
    graph = import_graph()
    entries = {
        target
        for module, targets in graph.items()
        if layer(module) != "runner"
        for target in targets
        if layer(target) == "runner"
    }
    assert entries == {"blockserve.runner.start"}
