"""An image that arrives encoded (a chat part's data: URL), decoded as vLLM's chat loader does
it: its EXIF orientation applied, converted to RGB (transparency flattened onto white), and
bounded before any pixel is decoded: a few bytes that claim a huge image are refused."""

from __future__ import annotations

import base64
import binascii
import contextlib
import io

from PIL import Image, ImageOps

from blockserve.errors import InvalidRequestError
from blockserve.multimodal.hasher import EncodedImage

FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
RGB_CONVERSION = {"image_mode": "RGB", "rgba_background_color": (255, 255, 255)}


def decode_data_url(url: str, param: str) -> EncodedImage:
    """A `data:image/...;base64,...` URL's image; InvalidRequestError naming `param` for a URL
    of another kind, or bytes that are not an image Pillow may decode."""
    head, comma, data = url.partition(",")
    if not (head.startswith("data:image/") and head.endswith(";base64") and comma):
        raise InvalidRequestError(
            "an image_url is a data:image/...;base64, URL (http(s) and file:// URLs are not "
            "served yet)",
            param,
        )
    try:
        raw = base64.b64decode(data, validate=True)
    except binascii.Error as exc:
        raise InvalidRequestError(f"the image's base64 cannot be read: {exc}", param) from None
    return decode_image(raw, param)


def decode_image(raw: bytes, param: str) -> EncodedImage:
    """Opening reads the header alone: Pillow refuses there an image of more than twice its
    MAX_IMAGE_PIXELS (178,956,970 pixels, vLLM's VLLM_MAX_IMAGE_PIXELS default), before any
    pixel is decoded; a truncated or foreign file fails at load."""
    try:
        image: Image.Image = Image.open(io.BytesIO(raw), formats=FORMATS)
        with contextlib.suppress(Exception):  # a malformed orientation tag: as it is
            image = ImageOps.exif_transpose(image)
        image.load()
    except (OSError, ValueError, Image.DecompressionBombError) as exc:
        raise InvalidRequestError(f"the image cannot be read: {exc}", param) from None
    converted = to_rgb(image)
    return EncodedImage(converted, raw, None if converted is image else RGB_CONVERSION)


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB as vLLM converts it: transparency flattened onto white, other modes converted."""
    if image.mode == "RGB":
        return image
    if image.mode in ("RGBA", "LA", "PA") or "transparency" in image.info:
        rgba = image if image.mode == "RGBA" else image.convert("RGBA")
        flat = Image.new("RGB", rgba.size, (255, 255, 255))
        flat.paste(rgba, mask=rgba.split()[3])
        return flat
    return image.convert("RGB")
