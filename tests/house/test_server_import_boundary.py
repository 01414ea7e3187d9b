"""The server speaks only to the engine client: it imports nothing below the engine."""

from __future__ import annotations

import ast
from pathlib import Path

import blockserve

PACKAGE = Path(blockserve.__file__).parent
BELOW_THE_ENGINE = ("blockserve.core", "blockserve.sched", "blockserve.runner", "blockserve.model")
# The engine's public surface: the client protocol and the data that crosses it, and the
# client implementation that serve.py builds.
ENGINE_SURFACE = {
    "blockserve.engine.client",
    "blockserve.engine.outputs",
    "blockserve.engine.request",
    "blockserve.engine.async_engine",
}


def imported_modules(path: Path) -> set[str]:
    modules = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            modules.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module is not None:
            modules.add(node.module)
    return modules


def test_server_imports_no_core_sched_runner_or_model() -> None:
    """No module of blockserve/server imports core, sched, runner or model."""
    offenders = {
        f"{path.name}: {module}"
        for path in sorted((PACKAGE / "server").glob("*.py"))
        for module in imported_modules(path)
        if module.startswith(BELOW_THE_ENGINE)
    }
    assert offenders == set()


def test_server_uses_only_the_engine_surface() -> None:
    """From blockserve.engine the server imports the client, its data and nothing else."""
    used = {
        module
        for path in (PACKAGE / "server").glob("*.py")
        for module in imported_modules(path)
        if module.startswith("blockserve.engine")
    }
    assert used <= ENGINE_SURFACE
    assert "blockserve.engine.client" in used


def test_config_imports_only_plain_data_below_it() -> None:
    """config.py sits below the scheduler, the runner and the engine: of core/ it imports the
    eviction choice and the hash functions' names alone, nothing of sched/ or engine/."""
    imports = imported_modules(PACKAGE / "config.py")
    core = {m for m in imports if m.startswith("blockserve.core")}
    assert core == {"blockserve.core.eviction", "blockserve.core.hashing"}
    assert not {m for m in imports if m.startswith(("blockserve.sched", "blockserve.engine"))}
