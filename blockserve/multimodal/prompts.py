"""A prompt's images into tokens for one vision-language model: each `<image>` of the text is
replaced by the text its image becomes (its tiles' tokens), the identifier computed, the span
of positions recorded; what vLLM's processor does for SmolVLM / Idefics3."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from blockserve.errors import InvalidRequestError
from blockserve.multimodal.hasher import item_identifier
from blockserve.multimodal.idefics3 import IMAGE_TOKEN, Idefics3Processing, image_prompt
from blockserve.multimodal.inputs import ImageInput

Encode = Callable[[str, bool], Sequence[int]]  # (text, add_special_tokens) -> token ids


@dataclass(frozen=True)
class ImagePrompts:
    """How one model's prompts take images: its processing, the tokens a tile becomes, and
    the model id its images' identifiers are hashed with (the served model, as vLLM's)."""

    processing: Idefics3Processing
    tokens_per_tile: int
    model_id: str
    hash_algorithm: str = "blake3"

    def expand(
        self, text: str, images: Sequence[Any], encode: Encode
    ) -> tuple[tuple[int, ...], tuple[ImageInput, ...]]:
        """The prompt's token ids, its images' replacements in place of each `<image>`, and
        the images as the engine takes them. Every boundary is a special token, so the text
        between images tokenizes alone as it would in the whole."""
        pieces = text.split(IMAGE_TOKEN)
        if len(pieces) - 1 != len(images):
            raise InvalidRequestError(
                f"the prompt has {len(pieces) - 1} {IMAGE_TOKEN} placeholders for "
                f"{len(images)} images",
                "multi_modal_data",
            )
        ids = list(encode(pieces[0], True))
        items = []
        for image, piece in zip(images, pieces[1:], strict=True):
            tiles = self.processing(image)
            replacement = encode(image_prompt(tiles.rows, tiles.cols, self.tokens_per_tile), False)
            identifier = item_identifier(self.hash_algorithm, self.model_id, image)
            items.append(
                ImageInput(
                    identifier=identifier,
                    offset=len(ids),
                    length=len(replacement),
                    pixel_values=tiles.pixel_values,
                )
            )
            ids += replacement
            ids += encode(piece, False)
        return tuple(ids), tuple(items)
