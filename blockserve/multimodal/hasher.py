"""A multimodal item's identifier, equal to vLLM 0.32's: the digest (blake3, sha256 or sha512)
of a length-framed, kind-tagged stream of the served model's id, the item and the processing
options, so that block keys with `("mm", identifier, offset)` match vLLM's for the same image."""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from PIL import Image

from blockserve.multimodal import ALGORITHMS

# The stream is uniquely decodable: every leaf's bytes follow their length (8 bytes, little
# endian), and every value its kind; a sequence and a mapping also their length.
_NONE, _SEQUENCE, _MAPPING, _LEAF = b"\x00", b"\x01", b"\x02", b"\x03"


@dataclass(frozen=True)
class EncodedImage:
    """An image that arrived encoded (a data: or http(s) URL, a file): hashed by the bytes it
    arrived as, not its pixels, and by `io_config`, the decoding settings that changed them
    (vLLM's: an RGBA image flattened onto a background to RGB)."""

    image: Image.Image
    original_bytes: bytes = field(repr=False)
    io_config: Mapping[str, Any] | None = None


def hash_kwargs(algorithm: str, **kwargs: Any) -> str:
    """The hex digest of `kwargs`, keys in sorted order (vLLM's `MultiModalHasher.hash_kwargs`)."""
    hasher = _hasher(algorithm)()
    for key in sorted(kwargs):
        for chunk in _keyed(key, kwargs[key]):
            hasher.update(chunk)
    return hasher.hexdigest()


def item_identifier(
    algorithm: str,
    model_id: str,
    image: Image.Image | EncodedImage | None,
    uuid_: str | None = None,
    processor_kwargs: Mapping[str, Any] | None = None,
) -> str:
    """An image item's identifier: a client's uuid as it is when nothing else changes the
    model's input, else the digest of the served model id, the image (or the uuid in its
    place) and the processor's options."""
    factors = {"mm_processor_kwargs": dict(processor_kwargs)} if processor_kwargs else {}
    if uuid_ is not None and not factors:
        return uuid_
    item = uuid_ if uuid_ is not None else image
    return hash_kwargs(algorithm, model_id=model_id, image=item, **factors)


def _hasher(algorithm: str) -> Callable[[], Any]:
    if algorithm == "blake3":
        from blake3 import blake3

        return blake3
    if algorithm in ("sha256", "sha512"):
        return getattr(hashlib, algorithm)
    raise ValueError(f"unknown multimodal hash algorithm {algorithm!r}: one of {ALGORITHMS}")


def _length(value: int) -> bytes:
    return value.to_bytes(8, "little")


def _framed(data: bytes | memoryview) -> Iterator[bytes | memoryview]:
    yield _length(data.nbytes if isinstance(data, memoryview) else len(data))
    yield data


def _keyed(key: str, value: Any) -> Iterator[bytes | memoryview]:
    yield from _framed(key.encode())
    yield from _value(value)


def _value(value: Any) -> Iterator[bytes | memoryview]:
    if value is None:
        yield _NONE
    elif isinstance(value, (list, tuple)):
        yield _SEQUENCE + _length(len(value))
        for element in value:
            yield from _value(element)
    elif isinstance(value, Mapping):
        yield _MAPPING + _length(len(value))
        for key, element in value.items():
            yield from _framed(str(key).encode())
            yield from _value(element)
    else:
        yield _LEAF
        yield from _leaf(value)


def _leaf(value: Any) -> Iterator[bytes | memoryview]:
    if isinstance(value, (bytes, memoryview)):
        yield from _framed(value)
    elif isinstance(value, str):
        yield from _framed(value.encode())
    elif isinstance(value, (int, float)):  # numpy's scalar bytes: int64, float64 (bool: 1)
        yield from _framed(np.array(value).tobytes())
    elif isinstance(value, EncodedImage):
        yield from _encoded_image(value)
    elif isinstance(value, Image.Image):
        yield from _decoded_image(value)
    elif isinstance(value, np.ndarray):
        yield from _array(value)
    else:
        raise TypeError(f"no identifier for a {type(value).__name__}")


def _encoded_image(item: EncodedImage) -> Iterator[bytes | memoryview]:
    image_id = _exif_image_id(item.image)
    if image_id is not None:
        yield from _framed(image_id)
    elif item.io_config:
        yield from _keyed("image", {"io_config": item.io_config, "data": item.original_bytes})
    else:
        yield from _keyed("image", item.original_bytes)


def _decoded_image(image: Image.Image) -> Iterator[bytes | memoryview]:
    image_id = _exif_image_id(image)
    if image_id is not None:
        yield from _framed(image_id)
        return
    data: dict[str, Any] = {"mode": image.mode, "data": np.asarray(image)}
    if image.palette is not None:
        data["palette"] = image.palette.palette
        if image.palette.rawmode is not None:
            data["palette_rawmode"] = image.palette.rawmode
    yield from _keyed("image", data)


def _array(array: np.ndarray) -> Iterator[bytes | memoryview]:
    if array.ndim == 0:
        data: Any = array.item()
    elif array.flags.c_contiguous:
        data = array.view(np.uint8).data
    else:
        data = array.tobytes()
    yield from _keyed("ndarray", {"dtype": array.dtype.str, "shape": array.shape, "data": data})


def _exif_image_id(image: Image.Image) -> bytes | None:
    """An image's EXIF ImageID, when it holds a UUID: it stands for the image (vLLM's rule)."""
    try:
        image_id = image.getexif().get(Image.ExifTags.Base.ImageID)
    except Exception:  # malformed EXIF: the image is hashed by its data instead
        return None
    return image_id.bytes if isinstance(image_id, uuid.UUID) else None
