"""Idefics3 / SmolVLM image processing with Pillow and numpy, pixel for pixel what the Hugging
Face processor computes: the image resized so its longest side is `longest_edge`, then to whole
tiles of `tile` pixels, cut into rows x cols tiles plus the whole image at tile size (the
"global" image), rescaled and normalised; and the prompt text that stands for it."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image

MAX_IMAGE_SIZE = 4096  # no side is resized beyond this, whatever longest_edge asks

FAKE_TOKEN = "<fake_token_around_image>"
IMAGE_TOKEN = "<image>"
GLOBAL_TOKEN = "<global-img>"


@dataclass(frozen=True)
class Tiles:
    """One image ready for the vision tower: `pixel_values` [tiles, 3, tile, tile] (float32;
    the rows x cols tiles row by row, then the global image), and its grid (0 x 0: the global
    image alone)."""

    pixel_values: np.ndarray
    rows: int
    cols: int


@dataclass(frozen=True)
class Idefics3Processing:
    """The image processor's settings (a model's preprocessor_config.json); the defaults are
    SmolVLM-256M-Instruct's."""

    longest_edge: int = 2048  # `size`: the longest side before tiling
    tile: int = 512  # `max_image_size`: a tile's side, the vision tower's input
    split: bool = True  # `do_image_splitting`: tiles and the global image, else the latter
    mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    std: tuple[float, ...] = (0.5, 0.5, 0.5)
    rescale_factor: float = 1 / 255
    resample: int = Image.Resampling.LANCZOS

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> Idefics3Processing:
        """From preprocessor_config.json's fields (absent ones keep their defaults)."""
        fields: dict[str, Any] = {}
        if "size" in config:
            fields["longest_edge"] = config["size"]["longest_edge"]
        if "max_image_size" in config:
            fields["tile"] = config["max_image_size"]["longest_edge"]
        if "do_image_splitting" in config:
            fields["split"] = bool(config["do_image_splitting"])
        for key, name in (("image_mean", "mean"), ("image_std", "std")):
            if key in config:
                fields[name] = tuple(float(v) for v in config[key])
        if "rescale_factor" in config:
            fields["rescale_factor"] = float(config["rescale_factor"])
        if "resample" in config:
            fields["resample"] = int(config["resample"])
        return cls(**fields)

    @property
    def max_tiles(self) -> int:
        """The most tiles an image becomes: a grid of the longest edge's, and the global one."""
        if not self.split:
            return 1
        return math.ceil(self.longest_edge / self.tile) ** 2 + 1

    def __call__(self, image: Image.Image) -> Tiles:
        image = to_rgb(image)
        if not self.split:
            image = self._resize(image, _fit_longest(image.height, image.width, self.longest_edge))
            return Tiles(self._normalized([self._resize(image, (self.tile, self.tile))]), 0, 0)
        image = self._resize(image, _fit_longest(image.height, image.width, self.longest_edge))
        image = self._resize(image, _whole_tiles(image.height, image.width, self.tile))
        if image.height <= self.tile and image.width <= self.tile:
            return Tiles(self._normalized([image]), 0, 0)
        rows = (image.height - self.tile) // self.tile + 1
        cols = (image.width - self.tile) // self.tile + 1
        crops = [
            image.crop((c * self.tile, r * self.tile, (c + 1) * self.tile, (r + 1) * self.tile))
            for r in range(rows)
            for c in range(cols)
        ]
        whole = self._resize(image, (self.tile, self.tile))
        return Tiles(self._normalized([*crops, whole]), rows, cols)

    def grid(self, height: int, width: int) -> tuple[int, int]:
        """The rows x cols of tiles an image of this size is cut into (0 x 0: not cut)."""
        if not self.split:
            return 0, 0
        height, width = _whole_tiles(*_fit_longest(height, width, self.longest_edge), self.tile)
        if height <= self.tile and width <= self.tile:
            return 0, 0
        return math.ceil(height / self.tile), math.ceil(width / self.tile)

    def _resize(self, image: Image.Image, size: tuple[int, int]) -> Image.Image:
        height, width = size
        return image.resize((width, height), self.resample)

    def _normalized(self, images: list[Image.Image]) -> np.ndarray:
        """[n, 3, H, W] float32: rescaled in float64, then (x - mean) / std in float32."""
        chw = np.stack([np.moveaxis(np.asarray(image), -1, 0) for image in images])
        scaled = (chw.astype(np.float64) * self.rescale_factor).astype(np.float32)
        mean = np.asarray(self.mean, dtype=np.float32)[:, None, None]
        std = np.asarray(self.std, dtype=np.float32)[:, None, None]
        return (scaled - mean) / std


def image_prompt(rows: int, cols: int, seq_len: int) -> str:
    """The text an image's `<image>` placeholder becomes: each tile's position token and
    `seq_len` image tokens, row by row, then the global image's."""
    tiles = "".join(
        "".join(
            f"{FAKE_TOKEN}<row_{r + 1}_col_{c + 1}>" + IMAGE_TOKEN * seq_len for c in range(cols)
        )
        + "\n"
        for r in range(rows)
    )
    whole = f"{FAKE_TOKEN}{GLOBAL_TOKEN}" + IMAGE_TOKEN * seq_len + FAKE_TOKEN
    return f"{tiles}\n{whole}" if rows or cols else whole


def image_seq_len(image_size: int, patch_size: int, scale_factor: int) -> int:
    """Image tokens per tile: the tower's patches, merged scale_factor^2 to one."""
    return (image_size // patch_size) ** 2 // scale_factor**2


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB, transparency composited onto white (what the processor does before anything)."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image if image.mode == "RGB" else image.convert("RGB")


def _fit_longest(height: int, width: int, longest: int) -> tuple[int, int]:
    """The longest side to `longest`, the other kept in proportion (even, at least 1), then
    both within MAX_IMAGE_SIZE."""
    aspect = width / height
    if width >= height:
        width, height = longest, int(longest / aspect)
        height += height % 2
    else:
        height, width = longest, int(longest * aspect)
        width += width % 2
    height, width = max(height, 1), max(width, 1)
    aspect = width / height
    if width >= height and width > MAX_IMAGE_SIZE:
        width, height = MAX_IMAGE_SIZE, int(MAX_IMAGE_SIZE / aspect)
    elif height > width and height > MAX_IMAGE_SIZE:
        height, width = MAX_IMAGE_SIZE, int(MAX_IMAGE_SIZE * aspect)
    return max(height, 1), max(width, 1)


def _whole_tiles(height: int, width: int, tile: int) -> tuple[int, int]:
    """Both sides up to whole tiles, the longest first and the other from the proportion."""
    aspect = width / height
    if width >= height:
        width = math.ceil(width / tile) * tile
        height = math.ceil(int(width / aspect) / tile) * tile
    else:
        height = math.ceil(height / tile) * tile
        width = math.ceil(int(height * aspect) / tile) * tile
    return height, width
