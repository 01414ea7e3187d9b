"""What an image of a prompt becomes before the engine core: its identifier (the block keys'
item), the span of prompt positions its replacement text fills, the positions in that span
the vision tower's tokens fill, and its tiles."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ImageInput:
    identifier: str
    offset: int
    length: int
    pixel_values: Any = None  # np.ndarray [tiles, 3, tile, tile] float32
    # Positions in the span (0 = `offset`) that take the tower's tokens, ascending: the
    # `<image>` tokens (vLLM's is_embed); their count is the image's size in the encoder cache.
    embed_positions: tuple[int, ...] = ()
