"""Server fixtures: one tiny-model server per module configuration, stopped with SIGINT."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.server.server_process import ServerProcess

TINY_ARGS = ["--dtype", "float32", "--num-gpu-blocks-override", "256"]


@pytest.fixture(scope="module")
def server(
    tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    """A tiny-model server with prefix caching on; asserts a clean exit (code 0) at the end."""
    process = ServerProcess(
        ["--model", str(tiny_llama_dir), *TINY_ARGS],
        tmp_path_factory.mktemp("server") / "server.log",
    )
    yield process
    assert process.stop() == 0, process.log()
