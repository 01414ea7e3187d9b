"""The README's examples run as written (against a tiny-model server served under the default
model's name, and the real embedded model offline), so they cannot rot."""

from __future__ import annotations

import contextlib
import io
import json
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import pytest

from blockserve.bench.server_process import ServerProcess
from tests.server.conftest import tiny_server

pytestmark = pytest.mark.slow  # a real server per module

README = (Path(__file__).parents[2] / "README.md").read_text()


def blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README, re.DOTALL)


@pytest.fixture(scope="module")
def readme_server(
    tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    # Compact JSON: the tiny model's random weights would pad every gap with whitespace.
    extra = [
        "--served-model-name",
        "SmolLM2-135M-Instruct",
        "--structured-outputs-max-whitespace",
        "0",
    ]
    yield from tiny_server(tiny_llama_dir, tmp_path_factory, extra)


def run_python(code: str) -> list[str]:
    """Execute a README block; its printed lines."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "README.md", "exec"), {})
    return out.getvalue().splitlines()


def test_the_curl_example_finishes(readme_server: ServerProcess) -> None:
    """The chat curl sets max_tokens and returns one finished choice."""
    (curl,) = [b for b in blocks("sh") if b.lstrip().startswith("curl") and "image" not in b]
    command = curl.replace("localhost:8000", readme_server.url.removeprefix("http://"))
    answer = json.loads(subprocess.run(["bash", "-c", command], capture_output=True).stdout)
    assert answer["choices"][0]["finish_reason"] in ("stop", "length")
    assert answer["usage"]["completion_tokens"] <= 32


def test_the_caching_example_shows_cached_tokens(readme_server: ServerProcess) -> None:
    """The second question reuses the system prompt: 0 cached tokens, then more than 0, and
    the explanation names the first block that missed."""
    (client_block,) = [b for b in blocks("python") if "OpenAI(" in b and "cached_tokens" in b]
    code = client_block.replace("http://localhost:8000", readme_server.url)
    first, second = run_python(code)
    assert int(first.split()[0]) == 0 and int(second.split()[0]) > 0
    assert "cache_explanation" in second and "first_missing_block" in second


def test_the_structured_output_example_validates(readme_server: ServerProcess) -> None:
    """The JSON-schema example prints JSON that validates against its schema."""
    (block,) = [b for b in blocks("python") if "response_format" in b]
    namespace: dict = {}
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(
            compile(block.replace("http://localhost:8000", readme_server.url), "README.md", "exec"),
            namespace,
        )
    jsonschema.validate(json.loads(out.getvalue()), namespace["place"])


def test_the_offline_example_reuses_the_prompt() -> None:
    """The real embedded model, float32: the second of two equal prompts hits the cache."""
    (offline,) = [b for b in blocks("python") if "LLM(" in b]
    printed = run_python(offline)  # the generated text may hold newlines of its own
    assert int(printed[0].split()[0]) > 0


def test_the_router_hash_example_holds() -> None:
    """The BlockHasher example's own assertion passes."""
    (hashing,) = [b for b in blocks("python") if "BlockHasher" in b]
    assert run_python(hashing) == []
