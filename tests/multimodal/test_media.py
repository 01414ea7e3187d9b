"""Image URLs decoded within their bounds, without a server: a data: URL whose bytes would pass
the size bound is refused before it is decoded, one within it is decoded to its pixels."""

from __future__ import annotations

import base64

import numpy as np
import pytest
from PIL import Image

from blockserve.errors import InvalidRequestError
from blockserve.multimodal.media import MediaPolicy, load_image_url
from tests.multimodal.images import pixels, png


def data_url(raw: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(raw).decode()


def test_a_data_url_within_the_bound_is_decoded_to_its_pixels() -> None:
    raw = png(Image.fromarray(pixels(5, 9, 7, 3)))
    image = load_image_url(data_url(raw), MediaPolicy(max_bytes=len(raw)), "messages")
    assert image.original_bytes == raw
    assert np.array_equal(np.asarray(image.image), pixels(5, 9, 7, 3))


def test_a_data_url_past_the_bound_is_refused_naming_the_part() -> None:
    raw = png(Image.fromarray(pixels(5, 90, 70, 3)))
    with pytest.raises(InvalidRequestError) as refused:
        load_image_url(data_url(raw), MediaPolicy(max_bytes=len(raw) - 3), "messages")
    assert str(refused.value) == f"the image is larger than {len(raw) - 3} bytes"
    assert refused.value.param == "messages"
