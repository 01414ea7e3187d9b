"""SmolVLM's image processing and prompt equal to transformers' (its Pillow backend, which
vLLM runs where torchvision is absent): pixel values bit for bit, the tile grid, and the text an
image becomes, for small, wide, tall, huge and transparent images, with and without tiling."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image
from transformers.models.smolvlm.image_processing_pil_smolvlm import SmolVLMImageProcessorPil
from transformers.models.smolvlm.processing_smolvlm import get_image_prompt_string

from blockserve.multimodal.idefics3 import (
    FAKE_TOKEN,
    GLOBAL_TOKEN,
    IMAGE_TOKEN,
    Idefics3Processing,
    image_prompt,
    image_seq_len,
)
from tests.multimodal.images import pixels

# SmolVLM-256M-Instruct's preprocessor_config.json, the fields that matter here.
CONFIG = {
    "size": {"longest_edge": 2048},
    "max_image_size": {"longest_edge": 512},
    "do_image_splitting": True,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "rescale_factor": 1 / 255,
    "resample": 1,
}


def image(height: int, width: int, mode: str = "RGB") -> Image.Image:
    channels = {"RGB": 3, "RGBA": 4, "L": 1}[mode]
    array = pixels(height * 7 + width, height, width, channels)
    return Image.fromarray(array[:, :, 0] if mode == "L" else array, mode=None)


@pytest.mark.parametrize(
    ("height", "width", "mode", "grid"),
    [
        (30, 40, "RGB", (3, 4)),  # small: up to 2048 on its longest side, then whole tiles
        (300, 700, "RGB", (2, 4)),
        (1100, 300, "L", (4, 2)),
        (3000, 2500, "RGB", (4, 4)),
        (64, 64, "RGBA", (4, 4)),
    ],
)
def test_pixels_and_grid_equal_transformers(
    height: int, width: int, mode: str, grid: tuple[int, int]
) -> None:
    picture = image(height, width, mode)
    ours = Idefics3Processing.from_config(CONFIG)(picture)
    theirs = SmolVLMImageProcessorPil(**CONFIG)(picture, return_row_col_info=True)
    assert (ours.rows, ours.cols) == (theirs["rows"][0][0], theirs["cols"][0][0]) == grid
    assert Idefics3Processing.from_config(CONFIG).grid(height, width) == grid
    expected = np.asarray(theirs["pixel_values"][0])
    assert ours.pixel_values.dtype == np.float32 and ours.pixel_values.shape == expected.shape
    assert np.array_equal(ours.pixel_values, expected)


def test_without_tiling_the_global_image_alone() -> None:
    config = {**CONFIG, "do_image_splitting": False}
    picture = image(300, 700)
    ours = Idefics3Processing.from_config(config)(picture)
    theirs = SmolVLMImageProcessorPil(**config)(picture, return_row_col_info=True)
    assert (ours.rows, ours.cols, ours.pixel_values.shape) == (0, 0, (1, 3, 512, 512))
    assert np.array_equal(ours.pixel_values, np.asarray(theirs["pixel_values"][0]))


@pytest.mark.parametrize(("rows", "cols"), [(0, 0), (1, 2), (4, 4)])
def test_the_prompt_equals_transformers(rows: int, cols: int) -> None:
    seq_len = image_seq_len(image_size=512, patch_size=16, scale_factor=4)
    assert seq_len == 64  # SmolVLM-256M: 32 x 32 patches, merged 4 x 4
    assert image_prompt(rows, cols, seq_len) == get_image_prompt_string(
        rows, cols, seq_len, FAKE_TOKEN, IMAGE_TOKEN, GLOBAL_TOKEN
    )
