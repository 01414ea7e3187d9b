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

pytestmark = pytest.mark.slow  # a real server per module


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


def test_a_prompt_cached_under_another_adapter_is_explained(lora_server: ServerProcess) -> None:
    """The same tokens cached under `every` miss for the base model: `other_namespace`."""
    import httpx

    prompt = [(11 * i + 5) % 300 + 1 for i in range(40)]
    body = {"prompt": prompt, "max_tokens": 1, "return_cache_explanation": True}
    url = f"{lora_server.url}/v1/completions"
    httpx.post(url, json={**body, "model": "every"}).raise_for_status()
    explanation = httpx.post(url, json=body).json()["usage"]["cache_explanation"]
    assert (explanation["first_missing_block"], explanation["reason"]) == (0, "other_namespace")


@pytest.fixture(scope="module")
def updating_server(
    tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    flags = ["--enable-lora", "--max-lora-rank", "8", "--allow-runtime-lora-updating"]
    yield from tiny_server(tiny_llama_dir, tmp_path_factory, flags)


def test_runtime_loading(updating_server: ServerProcess, adapter: Path, tmp_path: Path) -> None:
    """Load, serve, refuse a second load and a bad path, unload, then the name is a 404
    again (unloading while requests use it: tests/lora/test_lora.py)."""
    import httpx

    url = updating_server.url

    def post(route: str, **body: object) -> httpx.Response:
        return httpx.post(f"{url}/v1/{route}", json=body, timeout=60)

    loaded = post("load_lora_adapter", lora_name="late", lora_path=str(adapter))
    assert (loaded.status_code, loaded.text) == (
        200,
        "Success: LoRA adapter 'late' added successfully.",
    )
    assert "late" in [m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"]]
    assert post("completions", model="late", prompt="hi", max_tokens=2).status_code == 200
    again = post("load_lora_adapter", lora_name="late", lora_path=str(adapter))
    assert (again.status_code, again.json()["error"]["message"]) == (
        400,
        "The lora adapter 'late' has already been loaded.",
    )
    bad = post("load_lora_adapter", lora_name="bad", lora_path=str(tmp_path))
    assert (bad.status_code, bad.json()["error"]["param"]) == (400, "lora_path")
    assert "expected adapter_config.json" in bad.json()["error"]["message"]
    gone = post("unload_lora_adapter", lora_name="late")
    assert (gone.status_code, gone.text) == (
        200,
        "Success: LoRA adapter 'late' removed successfully.",
    )
    assert post("completions", model="late", prompt="hi", max_tokens=1).status_code == 404
    assert post("unload_lora_adapter", lora_name="late").status_code == 404


def test_hostile_loads_are_400s_and_an_unload_race_kills_nothing(
    updating_server: ServerProcess, adapter: Path, tmp_path: Path
) -> None:
    """A served model's name, a bad name, a bad config: 400s naming the field. Then the race
    that killed the engine: four requests under an adapter and its unload at once. Each
    request ends 200 or 404, the unload 200 or 400, and the engine serves on."""
    import asyncio
    import json
    import shutil

    import httpx

    url = updating_server.url
    base = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
    bad_config = tmp_path / "bad"
    shutil.copytree(adapter, bad_config)
    (bad_config / "adapter_config.json").write_text(json.dumps({"r": "abc"}))
    for name, path, param, message in [
        (base, adapter, "lora_name", f"the LoRA adapter name {base!r} is a served model's name"),
        ("a,b", adapter, "lora_name",
         "a LoRA adapter's name has no commas or control characters, got 'a,b'"),
        ("bad", bad_config, "lora_path",
         f"LoRA adapter 'bad' ({bad_config}): r must be an integer, got abc"),
    ]:  # fmt: skip
        body = {"lora_name": name, "lora_path": str(path)}
        response = httpx.post(f"{url}/v1/load_lora_adapter", json=body, timeout=60)
        error = response.json()["error"]
        assert (response.status_code, error["param"], error["message"]) == (400, param, message)

    async def race() -> tuple[list[int], int]:
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            body = {"lora_name": "racer", "lora_path": str(adapter)}
            (await client.post("/v1/load_lora_adapter", json=body)).raise_for_status()
            prompt = [(7 * i + 3) % 300 + 1 for i in range(200)]
            completions = [
                client.post(
                    "/v1/completions", json={"model": "racer", "prompt": prompt, "max_tokens": 4}
                )
                for _ in range(4)
            ]
            unload = client.post("/v1/unload_lora_adapter", json={"lora_name": "racer"})
            *answers, unloaded = await asyncio.gather(*completions, unload)
            return [a.status_code for a in answers], unloaded.status_code

    statuses, unload_status = asyncio.run(race())
    assert set(statuses) <= {200, 404} and unload_status in (200, 400)
    assert httpx.get(f"{url}/health").status_code == 200
    after = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=60)
    assert after.status_code == 200


def test_the_routes_are_off_without_the_flag(lora_server: ServerProcess) -> None:
    import httpx

    response = httpx.post(f"{lora_server.url}/v1/load_lora_adapter", json={})
    assert response.status_code == 404


def test_vllms_lora_info_gauge(lora_server: ServerProcess) -> None:
    """vllm:lora_requests_info, with vLLM's labels: the bound and the (idle) adapters; the
    read-back counters at zero (every adapter stayed in host memory)."""
    import time

    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    before = time.time()
    text = httpx.get(f"{lora_server.url}/metrics").text
    (family,) = [
        f for f in text_string_to_metric_families(text) if f.name == "vllm:lora_requests_info"
    ]
    (sample,) = family.samples
    assert sample.labels == {
        "max_lora": "1",
        "waiting_lora_adapters": "",
        "running_lora_adapters": "",
    }
    assert before - 1 <= sample.value <= time.time() + 1
    reads = {
        s.name: s.value
        for f in text_string_to_metric_families(text)
        if f.name.startswith("blockserve:lora_load")
        for s in f.samples
    }
    assert reads == {"blockserve:lora_loads_total": 0, "blockserve:lora_load_seconds_total": 0}


def test_bench_serve_spreads_groups_over_adapters(
    lora_server: ServerProcess, tmp_path: Path
) -> None:
    """`bench serve --lora-modules`: each shared-prefix group keeps one model (the adapter or
    the base), so each group's second prompt finds its 32-token system prompt cached."""
    import argparse
    import json

    from blockserve.bench.serve import add_arguments, run_command

    base = openai.OpenAI(base_url=f"{lora_server.url}/v1", api_key="unused").models.list()
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args([
        "--url", lora_server.url, "--dataset", "shared-prefix", "--num-groups", "2",
        "--prompts-per-group", "2", "--system-len", "32", "--question-len", "8",
        "--output-len", "2", "--concurrency", "1", "--max-token-id", "300", "--seed", "7",
        "--out-dir", str(tmp_path), "--lora-modules", "every", base.data[0].id,
    ])  # fmt: skip
    assert run_command(args) == 0
    run = json.loads((tmp_path / "serving-shared-prefix.json").read_text())["runs"]["caching on"]
    assert run["cached_tokens_reported"] == 2 * 32
    assert run["cached_share_per_model"] == {"every": 0.4, base.data[0].id: 0.4}
