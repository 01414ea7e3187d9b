"""Adapters that left host memory are read back between steps (the file cached by a thread,
converted within a budget): the request waits, others run meanwhile, the read is counted; a
read that fails ends that adapter's requests with the reason and nothing else."""

from __future__ import annotations

import shutil
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from blockserve.engine.llm_engine import LLMEngine
from blockserve.engine.outputs import RequestOutput
from blockserve.engine.request import RequestSpec
from blockserve.lora import host_set
from blockserve.lora.adapter import WEIGHTS, LoRAAdapter
from blockserve.lora.host_set import HostAdapters
from blockserve.lora.host_set import _into_page_cache as into_page_cache
from tests.lora.test_lora import GREEDY, PROMPTS, make_llm, reference


def fake_parts(name: str, path: str) -> Iterator[LoRAAdapter | None]:
    """Three parts, then the adapter."""
    yield from (None, None, None)
    yield LoRAAdapter(name=name, path=path, rank=1, weights={})


def adapter_dir(root: Path, name: str) -> str:
    (root / name).mkdir()
    (root / name / WEIGHTS).write_bytes(b"x" * 1000)
    return str(root / name)


def settle(host: HostAdapters) -> None:
    """Until no read is under way, every file cached, converted without a budget."""
    for _ in range(100):
        host.wait(0.1)
        host.advance(10.0)
        if not host._reads:
            return
    raise AssertionError("a read did not end")


def test_the_host_set_reads_back_and_keeps_the_most_recent(tmp_path: Path) -> None:
    host = HostAdapters(capacity=2, parts=fake_parts)
    paths = {name: adapter_dir(tmp_path, name) for name in "abc"}
    assert [host.request(n, p) for n, p in paths.items()] == [False, False, False]
    settle(host)
    # Three reads into two places: the least recently used one left again.
    assert [host.request(n, paths[n]) for n in "bc"] == [True, True]
    assert host.get("a") is None and (host.loads, len(host._lru)) == (3, 2)
    assert host.request("x", str(tmp_path / "missing")) is False
    settle(host)
    assert list(host.failed) == ["x"] and "No such file or directory" in host.failed["x"]
    assert host.request("x", str(tmp_path / "missing")) is False  # not again until taken
    assert not host._reads
    host.close()


def test_conversion_keeps_to_its_budget(tmp_path: Path) -> None:
    host = HostAdapters(capacity=2, parts=fake_parts)
    assert host.request("a", adapter_dir(tmp_path, "a")) is False
    host._reads["a"].cached.result(10)  # the file is cached
    host.advance(0.0)  # no time: nothing converted
    assert host.get("a") is None and host._reads["a"].parts is None
    host.advance(10.0)
    assert host.get("a") is not None and host.loads == 1 and not host._reads
    host.close()


def test_a_read_dropped_under_way_is_never_taken(tmp_path: Path) -> None:
    host = HostAdapters(capacity=2, parts=fake_parts)
    assert host.request("a", adapter_dir(tmp_path, "a")) is False
    host.drop("a")  # unloaded, or a new version added, meanwhile
    settle(host)
    assert host.get("a") is None and host.loads == 0
    host.close()


def evicted_engine(base: Path, adapters: dict[str, Path], every: Path) -> LLMEngine:
    """One slot, host memory for one adapter: `every` (registered first) has left it."""
    modules = (f"every={every}", f"qv={adapters['qv']}")
    engine = make_llm(base, max_loras=1, max_cpu_loras=1, lora_modules=modules).engine
    assert engine.lora_manager().host.get("every") is None
    return engine


@pytest.mark.slow
def test_a_request_waits_for_its_adapters_read_while_others_run(
    tiny_llama_dir: Path, adapters: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = evicted_engine(tiny_llama_dir, adapters, adapters["every"])
    release = threading.Event()

    def held(path: Path) -> None:  # the page-cache read, held until released
        release.wait(30)
        into_page_cache(path)

    monkeypatch.setattr(host_set, "_into_page_cache", held)
    engine.add_request(RequestSpec("base", PROMPTS[0], GREEDY))
    engine.add_request(RequestSpec("e", PROMPTS[1], GREEDY, lora_name="every"))
    tokens: dict[str, int] = {}
    for _ in range(4):  # the base request's prefill and 3 decodes, `every` still being read
        for output in engine.step():
            tokens[output.request_id] = len(output.outputs[0].token_ids)
    assert tokens == {"base": 4}
    assert engine.stats().lora.waiting == ("every",)  # type: ignore[union-attr]
    release.set()
    outputs = {}
    for _ in range(100):  # the read, a prefill and 8 decodes: bounded
        outputs |= {o.request_id: o for o in engine.step() if o.finished}
        if not engine.has_unfinished_requests():
            break
    want_tokens, want_logprobs = reference(tiny_llama_dir, adapters["every"], PROMPTS[1])
    assert list(outputs["e"].outputs[0].token_ids) == want_tokens
    got = [lp.logprob for lp in outputs["e"].outputs[0].logprobs or ()]
    assert got == pytest.approx(want_logprobs, abs=1e-4)
    stats = engine.stats().lora
    assert stats is not None and stats.loads == 1 and stats.load_seconds > 0


def run_to_end(engine: LLMEngine) -> dict[str, RequestOutput]:
    """Each request's final output, stepping until none is left (the read, a prefill and 8
    decodes: 100 steps bound it)."""
    finished = {}
    for _ in range(100):
        finished |= {o.request_id: o for o in engine.step() if o.finished}
        if not engine.has_unfinished_requests():
            break
    return finished


def test_a_failed_read_ends_that_adapters_requests_only(
    tiny_llama_dir: Path, adapters: dict[str, Path], tmp_path: Path
) -> None:
    every = Path(shutil.copytree(adapters["every"], tmp_path / "every"))
    engine = evicted_engine(tiny_llama_dir, adapters, every)
    shutil.rmtree(every)  # gone since it was registered
    engine.add_request(RequestSpec("e", PROMPTS[1], GREEDY, lora_name="every"))
    engine.add_request(RequestSpec("base", PROMPTS[0], GREEDY))
    finished = run_to_end(engine)
    assert finished["e"].outputs[0].finish_reason == "error"
    assert finished["e"].error is not None
    assert finished["e"].error.startswith("the LoRA adapter 'every' could not be read: ")
    assert str(every) in finished["e"].error
    base_tokens, _ = reference(tiny_llama_dir, None, PROMPTS[0])
    assert list(finished["base"].outputs[0].token_ids) == base_tokens


def test_a_read_back_of_changed_files_ends_that_adapters_requests(
    tiny_llama_dir: Path, adapters: dict[str, Path], tmp_path: Path
) -> None:
    """The adapter's files are replaced (other weights) after it left host memory: its blocks
    are keyed by the content it was loaded with, so the read back refuses the new content and
    its request ends with the reason; a base request beside it is untouched."""
    every = Path(shutil.copytree(adapters["every"], tmp_path / "every"))
    engine = evicted_engine(tiny_llama_dir, adapters, every)
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        shutil.copy(adapters["qv"] / name, every / name)
    engine.add_request(RequestSpec("e", PROMPTS[1], GREEDY, lora_name="every"))
    engine.add_request(RequestSpec("base", PROMPTS[0], GREEDY))
    finished = run_to_end(engine)
    assert finished["e"].error == (
        f"the LoRA adapter 'every' could not be read: LoRA adapter 'every' ({every}): its "
        "files changed since it was loaded; load it again to serve them"
    )
    base_tokens, _ = reference(tiny_llama_dir, None, PROMPTS[0])
    assert list(finished["base"].outputs[0].token_ids) == base_tokens
