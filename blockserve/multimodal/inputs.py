"""What an image of a prompt becomes before the engine core: its identifier (the block keys'
item), the span of prompt positions its replacement text fills, and its tiles."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ImageInput:
    identifier: str
    offset: int
    length: int
    pixel_values: Any = None  # np.ndarray [tiles, 3, tile, tile] float32
