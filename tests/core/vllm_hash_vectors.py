"""Writes vllm_hash_vectors.json beside it: block hashes and the KV events' extra keys that
vLLM's own code computes (its `Request`, `LoRARequest`, multimodal feature specs and
`get_request_block_hasher`), for every combination of extra keys. Run it with the peer
environment of `make peer-vllm`, where vLLM is installed (tests/core/test_hashing.py reads
the file; blockserve's environment has no vLLM):

    env -u PYTHONHASHSEED .peer/bin/python tests/core/vllm_hash_vectors.py
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

BLOCK_SIZE = 16
NUM_TOKENS = 56  # three full blocks and a partial one
IMAGES = [("img-aaa", 5, 20), ("img-bbb", 30, 10)]  # (identifier, offset, length)
LORA = ("adapter", "/adapters/capitals")

CASES: dict[str, dict[str, Any]] = {
    "none": {},
    "salt": {"cache_salt": "tenant-a"},
    "lora": {"lora": LORA},
    "salt+lora": {"cache_salt": "tenant-a", "lora": LORA},
    "mm": {"mm": IMAGES},
    "mm+lora+salt": {"mm": IMAGES, "lora": LORA, "cache_salt": "tenant-b"},
    "embeds": {"embeds": True},
}


def prompt_embeds() -> torch.Tensor:
    """The embeddings of the `embeds` case: [NUM_TOKENS, 4] float32, 0, 1, 2, ..."""
    return torch.arange(NUM_TOKENS * 4, dtype=torch.float32).reshape(NUM_TOKENS, 4)


def jsonable(value: Any) -> Any:
    """`value` as the JSON file holds it: tuples as lists, bytes as {"hex": ...}."""
    if isinstance(value, bytes):
        return {"hex": value.hex()}
    if isinstance(value, (tuple, list)):
        return [jsonable(v) for v in value]
    return value


def event_extra_keys(request: Any) -> Any:
    """A vLLM `Request`'s full blocks' extra keys as its BlockStored events publish them."""
    from vllm.v1.core import kv_cache_utils

    per_block = [
        kv_cache_utils.generate_block_hash_extra_keys(
            request, i * BLOCK_SIZE, (i + 1) * BLOCK_SIZE, 0
        )[0]
        for i in range(len(request.block_hashes))
    ]
    return jsonable(kv_cache_utils.to_event_extra_keys(per_block))


def vllm_case(algo: str, case: dict[str, Any]) -> dict[str, Any]:
    """The case's block hashes and event extra keys, as vLLM's own code computes them."""
    from vllm.lora.request import LoRARequest
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils
    from vllm.v1.request import Request

    hash_fn = get_hash_fn_by_name(algo)
    kv_cache_utils.init_none_hash(hash_fn)
    features = [
        MultiModalFeatureSpec(
            data=None,
            modality="image",
            identifier=identifier,
            mm_position=PlaceholderRange(offset=offset, length=length),
        )
        for identifier, offset, length in case.get("mm", [])
    ]
    lora = case.get("lora")
    request = Request(
        request_id="r",
        prompt_token_ids=list(range(100, 100 + NUM_TOKENS)),
        sampling_params=SamplingParams(max_tokens=1),
        pooling_params=None,
        prompt_embeds=prompt_embeds() if case.get("embeds") else None,
        mm_features=features or None,
        lora_request=None if lora is None else LoRARequest(lora[0], 1, lora[1]),
        cache_salt=case.get("cache_salt"),
        block_hasher=kv_cache_utils.get_request_block_hasher(BLOCK_SIZE, hash_fn),
    )
    return {
        "algo": algo,
        "block_hashes": [bytes(h).hex() for h in request.block_hashes],
        "event_extra_keys": event_extra_keys(request),
    }


def main() -> None:
    import vllm

    assert "PYTHONHASHSEED" not in os.environ, "run with PYTHONHASHSEED unset"
    vectors = {
        "vllm_version": vllm.__version__,
        "block_size": BLOCK_SIZE,
        "num_tokens": NUM_TOKENS,
        "cases": [
            {"name": name, **case, **vllm_case(algo, case)}
            for name, case in CASES.items()
            for algo in ("sha256", "sha256_cbor")
        ],
    }
    out = Path(__file__).with_suffix(".json")
    out.write_text(json.dumps(vectors, indent=1) + "\n")
    print(f"{len(vectors['cases'])} cases from vLLM {vllm.__version__} -> {out}")


if __name__ == "__main__":
    main()
