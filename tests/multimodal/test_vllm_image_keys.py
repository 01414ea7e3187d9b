"""Image prompts keyed as vLLM 0.32 keys them, end to end: the test SmolVLM served under its hub
id from a cache tree built here; each prompt of `image_cases` (three images, first and last in
two questions, a uuid, two images, sha256) gives vLLM's token ids, spans and identifiers, and
its BlockStored events vLLM's block hashes and extra keys. vLLM's processor and block hasher
computed them (tests/multimodal/vllm_image_vectors.py, pinned in image_vectors.json); the last
test recomputes them in the peer venv."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import huggingface_hub.constants
import pytest

from blockserve import LLM, SamplingParams
from blockserve.core.events import BlockStored, KVEventBatch
from blockserve.engine.request import ImagesPrompt, RequestSpec
from tests.core.vllm_hash_vectors import jsonable
from tests.multimodal.images import case_image, image_cases
from tests.multimodal.smolvlm_model import HUB_ID, save_test_smolvlm_hub
from tests.peer import NO_PEER, PEER_PYTHON, peer_json

pytestmark = pytest.mark.slow  # engines over SmolLM2's 135M weights

HERE = Path(__file__).parent
VECTORS = json.loads((HERE / "image_vectors.json").read_text())
CASES = {case["name"]: case for case in image_cases()}


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_test_smolvlm_hub(tmp_path_factory.mktemp("smolvlm-hub"))


@pytest.fixture(scope="module")
def engines(hub_cache: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    """An engine for each identifier algorithm, loaded by hub id offline, publishing events."""
    events = tmp_path_factory.mktemp("events")
    built = {}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
        for algorithm in ("blake3", "sha256"):
            built[algorithm] = LLM(
                HUB_ID,
                download_dir=str(hub_cache),
                dtype="float32",
                mm_hasher_algorithm=algorithm,
                kv_events_config={
                    "enable_kv_cache_events": True,
                    "publisher": "zmq",
                    "endpoint": f"ipc://{events}/{algorithm}",
                },
            )
    yield built
    for llm in built.values():
        llm.shutdown()


def ours(llm: LLM, case: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """The case through the engine: the input processor's ids, spans and identifiers, and the
    blocks the prompt's prefill stores, as its KV events publish them."""
    images = tuple(case_image(name) for name in case["images"])
    prompt: dict[str, Any] = {"prompt": case["prompt"], "multi_modal_data": {"image": images}}
    if case["uuids"] is not None:
        prompt["multi_modal_uuids"] = {"image": case["uuids"]}
    spec = RequestSpec(
        case["name"], ImagesPrompt(case["prompt"], images, tuple(case["uuids"] or ()))
    )
    validated = llm.engine.input_processor.process(spec, set())
    llm.reset_prefix_cache()
    batches: list[KVEventBatch] = []
    monkeypatch.setattr(llm.engine.core.event_publisher, "publish", batches.append)
    hasher = llm.engine.core.block_hasher
    hashed: list[bytes] = []

    def recording_hasher(*args: Any) -> list[bytes]:
        hashed.extend(new := hasher(*args))
        return new

    monkeypatch.setattr(llm.engine.core, "block_hasher", recording_hasher)
    llm.generate(prompt, SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
    stored = [e for b in batches for e in b.events if isinstance(e, BlockStored)]
    return {
        "name": case["name"],
        "prompt_token_ids": list(validated.prompt_token_ids),
        "spans": [[image.offset, image.length] for image in validated.images],
        "embeds": [len(image.embed_positions) for image in validated.images],
        "identifiers": [image.identifier for image in validated.images],
        "block_hashes": [h.hex() for h in hashed],
        "event_block_hashes": [h for e in stored for h in e.block_hashes],
        "event_extra_keys": jsonable([k for e in stored for k in e.extra_keys or []]),
    }


@pytest.mark.parametrize("expected", VECTORS["cases"], ids=[c["name"] for c in VECTORS["cases"]])
def test_image_prompts_are_keyed_as_vllm_keys_them(
    engines: dict[str, LLM], expected: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    assert VECTORS["vllm_version"] == "0.32.0"
    case = CASES[expected["name"]]
    assert ours(engines[case["algorithm"]], case, monkeypatch) == expected


@pytest.mark.skipif(not PEER_PYTHON.exists(), reason=NO_PEER)
def test_the_pinned_vectors_are_what_vllm_computes_now(hub_cache: Path) -> None:
    env = {"HF_HUB_CACHE": str(hub_cache), "HF_HUB_OFFLINE": "1"}
    assert peer_json(HERE / "vllm_image_vectors.py", env) == VECTORS
