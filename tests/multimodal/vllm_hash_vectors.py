"""Prints, as JSON, vLLM 0.32's identifiers for the images of tests/multimodal/images.py: run
by tests/multimodal/test_hasher.py with the peer venv's python (`make peer-vllm`), whose
output tests/multimodal/hash_vectors.json pins:

    .peer/bin/python tests/multimodal/vllm_hash_vectors.py > tests/multimodal/hash_vectors.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from vllm.multimodal.hasher import MultiModalHasher
from vllm.multimodal.media.base import MediaWithBytes

from tests.multimodal.images import MODEL_ID, RGB_CONVERSION, decoded_images, png


def vectors() -> dict[str, str]:
    out = {}
    images = decoded_images()
    for algorithm in ("blake3", "sha256", "sha512"):
        for name, image in images.items():
            out[f"{algorithm}/decoded/{name}"] = MultiModalHasher.hash_kwargs(
                algorithm, model_id=MODEL_ID, image=image
            )
        for name in ("rgb", "gray"):
            encoded = MediaWithBytes(images[name], png(images[name]))
            out[f"{algorithm}/encoded/{name}"] = MultiModalHasher.hash_kwargs(
                algorithm, model_id=MODEL_ID, image=encoded
            )
        rgba = images["rgba"]
        converted = MediaWithBytes(rgba.convert("RGB"), png(rgba), dict(RGB_CONVERSION))
        out[f"{algorithm}/encoded/rgba-as-rgb"] = MultiModalHasher.hash_kwargs(
            algorithm, model_id=MODEL_ID, image=converted
        )
        out[f"{algorithm}/uuid-with-kwargs"] = MultiModalHasher.hash_kwargs(
            algorithm,
            model_id=MODEL_ID,
            image="client-uuid-1",
            mm_processor_kwargs={"do_image_splitting": False, "size": {"longest_edge": 512}},
        )
        out[f"{algorithm}/other-model"] = MultiModalHasher.hash_kwargs(
            algorithm, model_id="HuggingFaceTB/SmolVLM-500M-Instruct", image=images["rgb"]
        )
    return out


if __name__ == "__main__":
    print(json.dumps(vectors(), indent=2, sort_keys=True))
