"""Prints, as JSON, what vLLM 0.32 makes of the image prompts of tests/multimodal/images.py
(`image_cases`) on the test SmolVLM served under its hub id: each prompt's token ids, its
images' spans, embedding counts and identifiers, its block hashes and BlockStored extra keys.
Run with the peer venv's python (`make peer-vllm`) on the hub cache tree the test builds;
the output is pinned in tests/multimodal/image_vectors.json:

    .venv/bin/python -m tests.multimodal.smolvlm_model /tmp/smolvlm-hub   # prints the cache
    cd tests/multimodal && env -u PYTHONHASHSEED HF_HUB_CACHE=/tmp/smolvlm-hub/cache \
        HF_HUB_OFFLINE=1 ../../.peer/bin/python vllm_image_vectors.py > image_vectors.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "vllm_site"))

from smolvlm_without_video import without_video_processor
from vllm.config import ModelConfig
from vllm.multimodal import MULTIMODAL_REGISTRY
from vllm.multimodal.inputs import MultiModalFeatureSpec
from vllm.multimodal.parse import parse_mm_uuids
from vllm.multimodal.processing.context import TimingContext
from vllm.multimodal.processing.inputs import ProcessorInputs
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core import kv_cache_utils
from vllm.v1.request import Request

from tests.core.vllm_hash_vectors import BLOCK_SIZE, event_extra_keys
from tests.multimodal.images import MODEL_ID, case_image, image_cases

BLOCK_HASH = "sha256"  # vLLM's --prefix-caching-hash-algo default


def vllm_case(case: dict[str, Any]) -> dict[str, Any]:
    config = ModelConfig(model=MODEL_ID, dtype="float32", mm_hasher_algorithm=case["algorithm"])
    processor = MULTIMODAL_REGISTRY.create_processor(config)
    ids = processor.info.get_tokenizer().encode(case["prompt"])
    items = processor.info.parse_mm_data({"image": [case_image(i) for i in case["images"]]})
    uuids = parse_mm_uuids(None if case["uuids"] is None else {"image": case["uuids"]})
    processed = processor.apply(ProcessorInputs(ids, items, uuids), TimingContext())
    spans = processed["mm_placeholders"]["image"]
    identifiers = processed["mm_hashes"]["image"]
    features = [
        MultiModalFeatureSpec(data=None, modality="image", identifier=i, mm_position=span)
        for i, span in zip(identifiers, spans, strict=True)
    ]
    request = Request(
        request_id="r",
        prompt_token_ids=[int(t) for t in processed["prompt_token_ids"]],
        sampling_params=SamplingParams(max_tokens=1),
        pooling_params=None,
        mm_features=features,
        block_hasher=kv_cache_utils.get_request_block_hasher(
            BLOCK_SIZE, get_hash_fn_by_name(BLOCK_HASH)
        ),
    )
    return {
        "name": case["name"],
        "prompt_token_ids": processed["prompt_token_ids"],
        "spans": [[span.offset, span.length] for span in spans],
        "embeds": [span.get_num_embeds() for span in spans],
        "identifiers": identifiers,
        "block_hashes": [bytes(h).hex() for h in request.block_hashes],
        "event_block_hashes": [
            kv_cache_utils.maybe_convert_block_hash(h) for h in request.block_hashes
        ],
        "event_extra_keys": event_extra_keys(request),
    }


if __name__ == "__main__":
    import os

    import vllm

    assert "PYTHONHASHSEED" not in os.environ, "run with PYTHONHASHSEED unset (vLLM's seed)"
    without_video_processor()
    kv_cache_utils.init_none_hash(get_hash_fn_by_name(BLOCK_HASH))
    cases = [vllm_case(case) for case in image_cases()]
    print(json.dumps({"vllm_version": vllm.__version__, "cases": cases}, indent=1))
