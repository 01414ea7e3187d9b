"""LoRA through a real server and the openai client: --lora-modules at start, /v1/models lists
each adapter with its parent, `model` picks the adapter (its tokens are peft's), the cache
keeps adapters apart, and a name nothing is served under is a 404."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from blockserve.bench.server_process import ServerProcess
from tests.lora.adapters import save_adapter
from tests.lora.test_lora import PROMPTS, reference
from tests.server.conftest import tiny_server


@pytest.fixture(scope="module")
def adapter(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_adapter(tiny_llama_dir, tmp_path_factory.mktemp("adapter") / "every", seed=1)


@pytest.fixture(scope="module")
def lora_server(
    tiny_llama_dir: Path, adapter: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    flags = ["--enable-lora", "--max-lora-rank", "8", "--lora-modules", f"every={adapter}"]
    yield from tiny_server(tiny_llama_dir, tmp_path_factory, flags)


def test_adapters_are_served_by_name(
    lora_server: ServerProcess, tiny_llama_dir: Path, adapter: Path
) -> None:
    client = openai.OpenAI(base_url=f"{lora_server.url}/v1", api_key="unused", max_retries=0)
    base, listed = (m.model_dump() for m in client.models.list().data)
    assert (listed["id"], listed["parent"], listed["root"]) == ("every", base["id"], str(adapter))

    def complete(model: str) -> tuple[list[int], int]:
        out = client.completions.create(
            model=model, prompt=PROMPTS[1], max_tokens=8, temperature=0,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )  # fmt: skip
        assert out.model == model and out.usage is not None
        details = out.usage.prompt_tokens_details
        assert details is not None
        return out.choices[0].token_ids, details.cached_tokens or 0  # type: ignore[attr-defined]

    (tuned, hit_a), (plain, hit_b), (again, hit_c) = (
        complete(name) for name in ("every", base["id"], "every")
    )
    assert tuned == again == reference(tiny_llama_dir, adapter, PROMPTS[1])[0]
    assert plain == reference(tiny_llama_dir, None, PROMPTS[1])[0]
    assert [hit_a, hit_b, hit_c] == [0, 0, 32]
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt="hi", max_tokens=1)
