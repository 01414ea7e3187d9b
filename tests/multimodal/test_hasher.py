"""Image identifiers byte for byte vLLM 0.32's: decoded images (RGB, grayscale, a palette,
RGBA), images that arrived encoded (by their bytes; an RGBA one flattened to RGB by its bytes
and the conversion), a client's uuid with processor options, another model; three algorithms.
The vectors were computed by vLLM's own MultiModalHasher (tests/multimodal/vllm_hash_vectors.py
in the peer venv); the slow test recomputes them there."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from PIL import Image

from blockserve.multimodal.hasher import ALGORITHMS, EncodedImage, hash_kwargs, item_identifier
from tests.multimodal.images import MODEL_ID, RGB_CONVERSION, decoded_images, png
from tests.peer import NO_PEER, PEER_PYTHON, peer_json

HERE = Path(__file__).parent
VECTORS = json.loads((HERE / "hash_vectors.json").read_text())


def ours() -> dict[str, str]:
    """The same inputs as vllm_hash_vectors.py, through blockserve's hasher."""
    out = {}
    images = decoded_images()
    for algorithm in ALGORITHMS:
        for name, image in images.items():
            out[f"{algorithm}/decoded/{name}"] = item_identifier(algorithm, MODEL_ID, image)
        for name in ("rgb", "gray"):
            encoded = EncodedImage(images[name], png(images[name]))
            out[f"{algorithm}/encoded/{name}"] = item_identifier(algorithm, MODEL_ID, encoded)
        rgba = images["rgba"]
        flattened = EncodedImage(rgba.convert("RGB"), png(rgba), RGB_CONVERSION)
        out[f"{algorithm}/encoded/rgba-as-rgb"] = item_identifier(algorithm, MODEL_ID, flattened)
        out[f"{algorithm}/uuid-with-kwargs"] = item_identifier(
            algorithm,
            MODEL_ID,
            None,
            uuid_="client-uuid-1",
            processor_kwargs={"do_image_splitting": False, "size": {"longest_edge": 512}},
        )
        other_model = "HuggingFaceTB/SmolVLM-500M-Instruct"
        out[f"{algorithm}/other-model"] = item_identifier(algorithm, other_model, images["rgb"])
    return out


def test_identifiers_equal_vllms() -> None:
    assert ours() == VECTORS
    assert len(set(VECTORS.values())) == len(VECTORS)  # every input its own identifier


def test_a_uuid_alone_is_the_identifier() -> None:
    """With no processor options a client's uuid stands for the image, as in vLLM."""
    assert item_identifier("sha256", MODEL_ID, decoded_images()["rgb"], uuid_="img-7") == "img-7"


def test_an_exif_image_id_stands_for_the_pixels() -> None:
    """Two images whose EXIF ImageID holds the same UUID share an identifier (vLLM's rule)."""
    import uuid

    first, second = decoded_images()["rgb"], decoded_images()["rgb-other"]
    tag = uuid.UUID(int=7)
    for image in (first, second):
        image.getexif()[Image.ExifTags.Base.ImageID] = tag
    assert item_identifier("sha256", MODEL_ID, first) == item_identifier("sha256", MODEL_ID, second)


def test_an_unknown_algorithm_or_value_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown multimodal hash algorithm 'md5'"):
        hash_kwargs("md5", image=b"x")
    with pytest.raises(TypeError, match="no identifier for a set"):
        hash_kwargs("sha256", image={1, 2})


@pytest.mark.slow
@pytest.mark.skipif(not PEER_PYTHON.exists(), reason=NO_PEER)
def test_the_pinned_vectors_are_what_vllm_computes_now() -> None:
    assert peer_json(HERE / "vllm_hash_vectors.py") == VECTORS
