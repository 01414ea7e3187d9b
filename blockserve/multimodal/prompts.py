"""A prompt's images into tokens for one vision-language model: each `<image>` of the text is
replaced by the text its image becomes (its tiles' tokens), the identifier computed, the span
of positions recorded; what vLLM's processor does for SmolVLM / Idefics3."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from blockserve.errors import InvalidRequestError
from blockserve.multimodal.hasher import EncodedImage, item_identifier
from blockserve.multimodal.idefics3 import IMAGE_TOKEN, Idefics3Processing, image_prompt
from blockserve.multimodal.inputs import ImageInput
from blockserve.multimodal.media import MediaPolicy
from blockserve.multimodal.processor_cache import ProcessorCache

Encode = Callable[[str, bool], Sequence[int]]  # (text, add_special_tokens) -> token ids


@dataclass(frozen=True)
class ImagePrompts:
    """How one model's prompts take images: its processing, the tokens a tile becomes, and
    the model id its images' identifiers are hashed with (the served model, as vLLM's)."""

    processing: Idefics3Processing
    tokens_per_tile: int
    image_token_id: int  # the token the tower's outputs replace (`<image>`, config.json's)
    model_id: str
    hash_algorithm: str = "blake3"
    limit: int = 999  # the most images one prompt may hold (--limit-mm-per-prompt)
    media: MediaPolicy = field(default_factory=MediaPolicy)  # where image URLs may point
    cache: ProcessorCache | None = None  # processed images by identifier (None: the cache off)

    @property
    def max_embeds(self) -> int:
        """The most tower tokens one image takes: its size in the encoder cache at most."""
        return self.processing.max_tiles * self.tokens_per_tile

    def check_count(self, count: int, param: str) -> None:
        if count > self.limit:
            raise InvalidRequestError(
                f"a prompt may hold at most {self.limit} images (--limit-mm-per-prompt), "
                f"this one holds {count}",
                param,
            )

    def expand(
        self,
        text: str,
        images: Sequence[Any],
        encode: Encode,
        uuids: Sequence[str | None] = (),
    ) -> tuple[tuple[int, ...], tuple[ImageInput, ...]]:
        """The prompt's token ids, its images' replacements in place of each `<image>`, and
        the images as the engine takes them (each under its uuid, where `uuids` gives one).
        Every boundary is a special token, so the text between images tokenizes alone as it
        would in the whole."""
        self.check_count(len(images), "multi_modal_data")
        pieces = text.split(IMAGE_TOKEN)
        if len(pieces) - 1 != len(images):
            raise InvalidRequestError(
                f"the prompt has {len(pieces) - 1} {IMAGE_TOKEN} placeholders for "
                f"{len(images)} images",
                "multi_modal_data",
            )
        ids = list(encode(pieces[0], True))
        items = []
        for index, (image, piece) in enumerate(zip(images, pieces[1:], strict=True)):
            uuid = uuids[index] if uuids else None
            replacement, item = self.image_tokens(image, len(ids), encode, uuid)
            items.append(item)
            ids += replacement
            ids += encode(piece, False)
        return tuple(ids), tuple(items)

    def image_tokens(
        self, image: Any, offset: int, encode: Encode, uuid: str | None = None
    ) -> tuple[Sequence[int], ImageInput]:
        """One image's tokens (the text its tiles become), placed at prompt position `offset`:
        a PIL image hashed by its pixels, an `EncodedImage` by the bytes it arrived as, or a
        client's `uuid` standing for either (vLLM's rule)."""
        pixels = image.image if isinstance(image, EncodedImage) else image
        identifier = item_identifier(self.hash_algorithm, self.model_id, image, uuid)
        if self.cache is None:
            tiles = self.processing(pixels)
        else:
            tiles = self.cache.get(identifier, lambda: self.processing(pixels))
        replacement = encode(image_prompt(tiles.rows, tiles.cols, self.tokens_per_tile), False)
        item = ImageInput(
            identifier=identifier,
            offset=offset,
            length=len(replacement),
            pixel_values=tiles.pixel_values,
            embed_positions=tuple(i for i, t in enumerate(replacement) if t == self.image_token_id),
        )
        return replacement, item
