"""Hub ids resolved through huggingface_hub's real code, offline: a cache tree laid out as
huggingface_hub writes it (refs, snapshots of links into blobs) around tiny models; revisions;
a clear line when the model is neither cached nor reachable; the environment honoured."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import huggingface_hub.constants
import pytest

from blockserve.errors import ModelNotFoundError
from blockserve.model.hub import is_hub_id
from blockserve.model.loader import resolve_model_dir
from tests.hub_cache import add_snapshot
from tests.tiny_models import save_tiny_model

REPO = "test-org/tiny-llama"
MAIN = "a" * 40  # commit hashes
TAGGED = "b" * 40
UNREACHABLE = "http://127.0.0.1:9"  # the discard port: nothing listens


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """REPO at main (seed 0) and at tag v1 (seed 1: other weights)."""
    root = tmp_path_factory.mktemp("hub")
    cache = root / "cache"
    for commit, seed, refs in ((MAIN, 0, ("main",)), (TAGGED, 1, ("v1",))):
        model = save_tiny_model(root / f"model-{seed}", seed=seed)
        add_snapshot(cache, REPO, commit, model, refs)
    return cache


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


def greedy(model: str, **engine: object) -> list[int]:
    from blockserve import LLM, SamplingParams

    llm = LLM(model, dtype="float32", device="cpu", num_gpu_blocks_override=32, **engine)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    (result,) = llm.generate([[5, 6, 7, 8, 9]], params, use_tqdm=False)
    name = llm.engine.core.info.model_name
    llm.shutdown()
    return [*result.outputs[0].token_ids, name]


def test_hub_ids_are_told_from_paths(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "org").mkdir()
    (tmp_path / "org" / "model").mkdir()
    monkeypatch.chdir(tmp_path)
    assert [is_hub_id(m) for m in (REPO, "gpt2", "org/model", "./x", "/abs/x", "a/b/c")] == [
        True, True, False, False, False, False,
    ]  # fmt: skip


def test_a_cached_model_loads_offline_as_its_directory_does(hub_cache: Path, offline: None) -> None:
    snapshot = resolve_model_dir(REPO, download_dir=str(hub_cache))
    assert snapshot == hub_cache / "models--test-org--tiny-llama" / "snapshots" / MAIN
    from_hub = greedy(REPO, download_dir=str(hub_cache))
    assert from_hub[:-1] == greedy(str(snapshot))[:-1]
    assert from_hub[-1] == REPO  # served under its hub id, as vLLM serves it


def test_a_revision_picks_its_snapshot(hub_cache: Path, offline: None) -> None:
    for revision, commit in (("v1", TAGGED), (TAGGED, TAGGED), ("main", MAIN), (None, MAIN)):
        path = resolve_model_dir(REPO, revision=revision, download_dir=str(hub_cache))
        assert path.name == commit
    main, tagged = (greedy(REPO, download_dir=str(hub_cache), revision=r) for r in ("main", "v1"))
    assert (
        tagged[:-1]
        == greedy(str(hub_cache / "models--test-org--tiny-llama" / "snapshots" / TAGGED))[:-1]
    )
    assert main != tagged


def test_not_cached_and_offline_is_one_clear_line(hub_cache: Path, offline: None) -> None:
    with pytest.raises(ModelNotFoundError) as error:
        resolve_model_dir("test-org/absent", download_dir=str(hub_cache))
    message = str(error.value)
    assert message.startswith(
        "test-org/absent is not in the local cache and the hub cannot be reached: "
    )
    assert "\n" not in message
    with pytest.raises(ModelNotFoundError, match="at revision 'v9' is not in the local cache"):
        resolve_model_dir(REPO, revision="v9", download_dir=str(hub_cache))


def test_an_unreachable_hub_falls_back_to_the_cache(
    hub_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Online, with the hub at a port where nothing listens: the cached model is used; an
    uncached one fails naming the connection error."""
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", UNREACHABLE)
    monkeypatch.setenv("HF_HUB_ETAG_TIMEOUT", "2")
    assert resolve_model_dir(REPO, download_dir=str(hub_cache)).name == MAIN
    with pytest.raises(ModelNotFoundError, match=r"cannot be reached: .*Connect"):
        resolve_model_dir("test-org/absent", download_dir=str(hub_cache))


def test_the_tokenizer_flag_takes_a_hub_id(hub_cache: Path, offline: None) -> None:
    tokens = greedy(str(hub_cache / "models--test-org--tiny-llama" / "snapshots" / MAIN))
    assert greedy(REPO, download_dir=str(hub_cache), tokenizer=REPO)[:-1] == tokens[:-1]
    with pytest.raises(ModelNotFoundError, match="no tokenizer at '/nonexistent'"):
        greedy(REPO, download_dir=str(hub_cache), tokenizer="/nonexistent")


@pytest.mark.slow
def test_the_hub_environment_is_honoured(hub_cache: Path, tmp_path: Path) -> None:
    """HF_HUB_CACHE and HF_HUB_OFFLINE, read by huggingface_hub in a process of their own."""
    code = (
        "from blockserve import LLM, SamplingParams\n"
        f"llm = LLM({REPO!r}, dtype='float32', device='cpu', num_gpu_blocks_override=32)\n"
        "print(llm.engine.core.info.model_path)\n"
    )
    env = {**os.environ, "HF_HUB_CACHE": str(hub_cache), "HF_HUB_OFFLINE": "1"}
    env["BLOCKSERVE_CACHE_DIR"] = str(tmp_path / "blockserve")
    run = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120,
        cwd=tmp_path,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip().splitlines()[-1] == str(
        hub_cache / "models--test-org--tiny-llama" / "snapshots" / MAIN
    )
