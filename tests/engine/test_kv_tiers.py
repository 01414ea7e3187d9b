"""The KV tiers in a real engine on the tiny model: a prompt evicted from the device comes back
from the host or disk tier, with the same greedy tokens as a fresh compute; a second engine on
the same directory hits at once; another model's directory is left alone."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from blockserve import LLM, SamplingParams
from blockserve.core.events import BlockStored, KVEventBatch
from blockserve.engine.outputs import RequestOutput
from blockserve.errors import InvalidConfigError
from tests.tiny_models import save_tiny_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=0)
# 12 device blocks (11 usable, 176 tokens): three other 80-token prompts evict a fourth.
SMALL_DEVICE = dict(dtype="float32", num_gpu_blocks_override=12)
PROMPT = [(t * 3) % 290 + 5 for t in range(80)]  # 5 full blocks, 4 of them hittable
OTHERS = [[(t * 7 + k) % 300 + 10 for t in range(80)] for k in range(3)]


def run(llm: LLM, prompt: list[int]) -> RequestOutput:
    (output,) = llm.generate([prompt], GREEDY, use_tqdm=False)
    return output


def logprobs(output: RequestOutput) -> list[float]:
    assert output.outputs[0].logprobs is not None
    return [lp.logprob for lp in output.outputs[0].logprobs]


@pytest.fixture(scope="module")
def fresh(tiny_llama_dir: Path) -> RequestOutput:
    """The prompt computed from scratch, with prefix caching off."""
    llm = LLM(str(tiny_llama_dir), dtype="float32", enable_prefix_caching=False)
    return run(llm, PROMPT)


@pytest.fixture
def disk_llm(tiny_llama_dir: Path, tmp_path: Path) -> Iterator[LLM]:
    llm = LLM(str(tiny_llama_dir), **SMALL_DEVICE, kv_cache_dir=str(tmp_path / "kv"))
    yield llm
    llm.shutdown()


def assert_same_as_fresh(output: RequestOutput, fresh: RequestOutput) -> None:
    assert output.outputs[0].token_ids == fresh.outputs[0].token_ids
    assert logprobs(output) == pytest.approx(logprobs(fresh), abs=1e-4)


@pytest.mark.slow
def test_an_evicted_prompt_comes_back_from_disk(disk_llm: LLM, fresh: RequestOutput) -> None:
    """Its 4 hittable blocks load from disk: cached_tokens 64, all of them from the disk, and
    the greedy tokens and their logprobs are a fresh compute's."""
    assert run(disk_llm, PROMPT).num_cached_tokens == 0
    for other in OTHERS:
        run(disk_llm, other)
    again = run(disk_llm, PROMPT)
    assert (again.num_cached_tokens, again.tier_cached_tokens) == (64, {"disk": 64})
    assert_same_as_fresh(again, fresh)
    (disk,) = disk_llm.engine.stats().kv_tiers
    assert (disk.name, disk.hits, disk.loads, disk.corrupt) == ("disk", 4, 1, 0)
    assert disk.stores == 5 + 3 * 5  # every full block of every prompt, once
    assert disk_llm.engine.kv_cache_report().integrity_errors == ()


def test_the_host_tier_serves_before_the_disk(tiny_llama_dir: Path, tmp_path: Path) -> None:
    llm = LLM(
        str(tiny_llama_dir),
        **SMALL_DEVICE,
        kv_offloading_size=0.001,  # 128 of the tiny model's 8 KiB blocks
        kv_cache_dir=str(tmp_path / "kv"),
    )
    try:
        first = run(llm, PROMPT)
        for other in OTHERS:
            run(llm, other)
        again = run(llm, PROMPT)
        assert (again.num_cached_tokens, again.tier_cached_tokens) == (64, {"host": 64})
        assert again.outputs[0].token_ids == first.outputs[0].token_ids
        host, disk = llm.engine.stats().kv_tiers
        assert (host.hits, disk.hits) == (4, 0)
    finally:
        llm.shutdown()


def test_a_second_engine_on_the_directory_hits_at_once(
    tiny_llama_dir: Path, tmp_path: Path, fresh: RequestOutput
) -> None:
    first = LLM(str(tiny_llama_dir), **SMALL_DEVICE, kv_cache_dir=str(tmp_path / "kv"))
    run(first, PROMPT)
    first.shutdown()  # flushes the queued writes and frees the directory
    second = LLM(str(tiny_llama_dir), **SMALL_DEVICE, kv_cache_dir=str(tmp_path / "kv"))
    try:
        output = run(second, PROMPT)
        assert (output.num_cached_tokens, output.tier_cached_tokens) == (64, {"disk": 64})
        assert_same_as_fresh(output, fresh)
    finally:
        second.shutdown()


def test_another_models_directory_is_left_alone(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """Same shapes, other weights: the fingerprint differs, so no block of it is served."""
    kv = str(tmp_path / "kv")
    first = LLM(str(tiny_llama_dir), **SMALL_DEVICE, kv_cache_dir=kv)
    run(first, PROMPT)
    first.shutdown()
    other_model = save_tiny_model(tmp_path / "other", seed=1)
    second = LLM(str(other_model), **SMALL_DEVICE, kv_cache_dir=kv)
    try:
        assert second.engine.core.kv_tiers is None
        assert run(second, PROMPT).num_cached_tokens == 0
        assert len(list((tmp_path / "kv" / "blocks").glob("*/*.kv"))) == 5
    finally:
        second.shutdown()


def test_tier_events_carry_their_medium(
    tiny_llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The published batches store the prompt's blocks as "GPU" (the device) and as "DISK",
    with the same hashes."""
    endpoint = f"ipc://{tmp_path}/events"
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint}
    llm = LLM(
        str(tiny_llama_dir),
        **SMALL_DEVICE,
        kv_cache_dir=str(tmp_path / "kv"),
        kv_events_config=config,
    )
    batches: list[KVEventBatch] = []
    monkeypatch.setattr(llm.engine.core.event_publisher, "publish", batches.append)
    run(llm, PROMPT)
    llm.shutdown()
    stored: dict[str | None, list[object]] = {}
    for event in (e for batch in batches for e in batch.events):
        if isinstance(event, BlockStored):
            stored.setdefault(event.medium, []).extend(event.block_hashes)
    assert len(stored["DISK"]) == 5 and sorted(stored["DISK"]) == sorted(stored["GPU"])  # type: ignore[type-var]


def test_tiers_need_prefix_caching(tiny_llama_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(InvalidConfigError, match="need enable_prefix_caching"):
        LLM(str(tiny_llama_dir), enable_prefix_caching=False, kv_cache_dir=str(tmp_path))
