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


# Image prompts whose tokens, spans, identifiers and block keys vLLM's processor computed
# (tests/multimodal/vllm_image_vectors.py): three images of other shapes, each first and last
# in each of two questions; a uuid; two images in one prompt; sha256 identifiers.
QUESTIONS = ("Describe the image.", "What colour is the top left corner, and why is it so?")
SHAPES = {"wide": (40, 70), "tall": (90, 30), "square": (64, 64)}  # (height, width)


def case_image(name: str) -> Image.Image:
    height, width = SHAPES[name]
    return Image.fromarray(pixels(len(name), height, width, 3))


def chat_text(user: str) -> str:
    return f"<|im_start|>User:{user}<end_of_utterance>\nAssistant:"


def image_cases() -> list[dict[str, Any]]:
    """Each case: its name, prompt text, image names, uuids (or None) and hash algorithm."""
    cases = [
        {
            "name": f"{image}/q{q}/{where}",
            "prompt": chat_text(f"<image>{question}" if where == "first" else f"{question}<image>"),
            "images": [image],
            "uuids": None,
            "algorithm": "blake3",
        }
        for image in SHAPES
        for q, question in enumerate(QUESTIONS)
        for where in ("first", "last")
    ]
    two = chat_text(f"<image>and<image>: {QUESTIONS[1]}")
    return [
        *cases,
        {**cases[0], "name": "wide/uuid", "uuids": ["client-cat-1"]},
        {**cases[0], "name": "wide/two", "prompt": two, "images": ["wide", "tall"]},
        {**cases[0], "name": "wide/sha256", "algorithm": "sha256"},
    ]
