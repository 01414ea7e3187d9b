"""A model's generation_config.json sets the server's sampling defaults; a request overrides."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from blockserve.bench.server_process import ServerProcess
from tests.server.conftest import tiny_server

pytestmark = pytest.mark.slow  # a real server per module

CONFIG = {"temperature": 0, "max_new_tokens": 6}


@pytest.fixture(scope="module")
def server(
    tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    model = tmp_path_factory.mktemp("generation-defaults") / "model"
    shutil.copytree(tiny_llama_dir, model)
    (model / "generation_config.json").write_text(json.dumps(CONFIG))
    yield from tiny_server(model, tmp_path_factory)


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def complete(client: openai.OpenAI, **kwargs: object) -> openai.types.Completion:
    return client.completions.create(  # type: ignore[call-overload, no-any-return]
        model=None, prompt="the quick brown", n=3, extra_body={"ignore_eos": True}, **kwargs
    )


def test_defaults_are_shown_at_start(server: ServerProcess) -> None:
    assert (
        "default sampling parameters from the model's generation config (a request's own "
        "values win; --generation-config vllm ignores them): temperature=0.0, max_tokens=6"
    ) in server.log()


def test_unset_fields_take_the_model_defaults(client: openai.OpenAI) -> None:
    """temperature 0 from the config: the three samples are the same greedy text; the
    config's max_new_tokens caps the API's default of 16."""
    out = complete(client)
    assert len({c.text for c in out.choices}) == 1
    assert out.usage is not None and out.usage.completion_tokens == 3 * 6


def test_a_request_overrides_the_defaults(client: openai.OpenAI) -> None:
    """A request's own temperature wins; its max_tokens is capped by the config's, as vLLM
    caps it, and a smaller one is kept."""
    sampled = complete(client, temperature=1.0, seed=7, max_tokens=50)
    assert len({tuple(c.text) for c in sampled.choices}) > 1
    assert sampled.usage is not None and sampled.usage.completion_tokens == 3 * 6
    short = complete(client, max_tokens=2)
    assert short.usage is not None and short.usage.completion_tokens == 3 * 2
