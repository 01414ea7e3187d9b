"""Server fixtures: tiny-model servers in real processes, each stopped with SIGINT at the end
of its module and required to exit with code 0, no exception having escaped the app."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from blockserve.bench.server_process import ServerProcess

TINY_ARGS = ["--dtype", "float32", "--num-gpu-blocks-override", "256", "--enable-debug-endpoints"]


def tiny_server(
    model_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
    extra_args: list[str] | None = None,
    env: dict[str, str] | None = None,
) -> Iterator[ServerProcess]:
    """Start a tiny-model server, yield it, then stop it and check its clean exit."""
    process = ServerProcess(
        ["--model", str(model_dir), *TINY_ARGS, *(extra_args or [])],
        tmp_path_factory.mktemp("server") / "server.log",
        env=env,
    )
    yield process
    assert process.stop() == 0, process.log()
    # No exception escaped the app, whatever the module's tests did (a client that hung up
    # included): uvicorn logs this line for each one.
    assert "Exception in ASGI application" not in process.log_path.read_text(errors="replace")


@pytest.fixture(scope="module")
def server(
    tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    """A tiny-model server with prefix caching on."""
    yield from tiny_server(tiny_llama_dir, tmp_path_factory)
