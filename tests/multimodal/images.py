"""The images the identifier vectors are computed on, built the same way in this venv and in
the peer vLLM's (numpy and Pillow only): pixels from a formula, PNG bytes by Pillow."""

from __future__ import annotations

import io
from typing import Any

import numpy as np
from PIL import Image

MODEL_ID = "HuggingFaceTB/SmolVLM-256M-Instruct"


def pixels(seed: int, height: int, width: int, channels: int) -> np.ndarray:
    y, x, c = np.indices((height, width, channels))
    return ((x * 37 + y * 11 + c * 101 + seed * 53) % 256).astype(np.uint8)


def decoded_images() -> dict[str, Image.Image]:
    """Images given as pixels (offline `multi_modal_data`): RGB, grayscale, a palette, RGBA."""
    palette = Image.fromarray(pixels(3, 6, 5, 3)).convert("P", palette=Image.Palette.ADAPTIVE)
    return {
        "rgb": Image.fromarray(pixels(0, 6, 8, 3)),
        "rgb-other": Image.fromarray(pixels(1, 6, 8, 3)),
        "gray": Image.fromarray(pixels(2, 7, 5, 1)[:, :, 0]),
        "palette": palette,
        "rgba": Image.fromarray(pixels(4, 4, 4, 4)),
    }


def png(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    return buffer.getvalue()


# An RGBA image arriving as a URL is flattened onto this background, as vLLM's chat loader does.
RGB_CONVERSION: dict[str, Any] = {"image_mode": "RGB", "rgba_background_color": (255, 255, 255)}
