"""The encoder cache's bookkeeping, vLLM 0.32's rules: the vision tower's output of each image,
counted in embeddings and keyed by the image's identifier, referenced by the requests that still
need it; an unreferenced entry stays until space is needed (oldest first), and the evicted ids
go to the runner with the next step. The tensors live in the runner; this holds no torch."""

from __future__ import annotations

from bisect import bisect_left
from collections import OrderedDict
from collections.abc import Sequence
from typing import Protocol

from blockserve.core.kv_cache_manager import RequestId


class EncoderInput(Protocol):
    """One image of a request as the scheduler reads it (multimodal/inputs.py's ImageInput)."""

    @property
    def identifier(self) -> str: ...

    @property
    def offset(self) -> int: ...

    @property
    def length(self) -> int: ...

    @property
    def embed_positions(self) -> Sequence[int]: ...  # in the span, those the tower's tokens fill


def embeds_in(image: EncoderInput, start: int, end: int) -> int:
    """How many of the image's embeddings fall in prompt positions [start, end)."""
    positions = image.embed_positions
    first, last = start - image.offset, end - image.offset
    return bisect_left(positions, last) - bisect_left(positions, first)


class EncoderCacheManager:
    """Which images' tower outputs the runner holds. `cache_size` is in embeddings; with
    `keep_unreferenced` False (the cache off) an entry goes as soon as no request needs it.

    An entry's references are request ids; an entry none refers to is `freeable` (oldest
    first) and is evicted only when an allocation needs its space. Eviction happens here and
    is sent to the runner with the next step (`take_freed`)."""

    def __init__(self, cache_size: int, keep_unreferenced: bool = True) -> None:
        self.cache_size = cache_size
        self.keep_unreferenced = keep_unreferenced
        self.num_free = cache_size  # embeddings not held by any entry
        self.num_freeable = cache_size  # free, or held by unreferenced entries
        self._refs: dict[str, set[RequestId]] = {}  # identifier -> requests that need it
        self._size: dict[str, int] = {}  # identifier -> its embeddings
        self._inputs: dict[RequestId, set[int]] = {}  # request -> its images referenced here
        self._freeable: OrderedDict[str, int] = OrderedDict()
        self._freed: list[str] = []

    def __contains__(self, identifier: str) -> bool:
        return identifier in self._refs

    def __len__(self) -> int:
        return len(self._refs)

    def reference(self, request_id: RequestId, index: int, identifier: str) -> bool:
        """If the image is held, count `request_id` among its users and return True."""
        refs = self._refs.get(identifier)
        if refs is None:
            return False
        if not refs:
            self.num_freeable -= self._freeable.pop(identifier)
        refs.add(request_id)
        self._inputs.setdefault(request_id, set()).add(index)
        return True

    def can_allocate(self, num_embeds: int, budget: int, num_scheduled: int) -> bool:
        """Whether `num_embeds` more (after `num_scheduled` already chosen this step) fit the
        step's encoder budget and the cache, evicting unreferenced entries, oldest first, as
        needed; False changes nothing."""
        if num_embeds > budget:
            return False
        needed = num_embeds + num_scheduled
        if needed > self.num_freeable:
            return False
        while needed > self.num_free:
            identifier, size = self._freeable.popitem(last=False)
            self._evict(identifier, size)
        return True

    def allocate(self, request_id: RequestId, index: int, identifier: str, num_embeds: int) -> None:
        """Hold the image's embeddings for `request_id` (after `can_allocate`)."""
        assert identifier not in self._refs and num_embeds <= self.num_free
        self._refs[identifier] = {request_id}
        self._size[identifier] = num_embeds
        self._inputs.setdefault(request_id, set()).add(index)
        self.num_free -= num_embeds
        self.num_freeable -= num_embeds

    def inputs_of(self, request_id: RequestId) -> frozenset[int]:
        return frozenset(self._inputs.get(request_id, ()))

    def release(self, request_id: RequestId, index: int, images: Sequence[EncoderInput]) -> None:
        """`request_id` no longer needs its image `index` (its span is in the KV cache, or the
        request ended); the entry stays until its space is wanted, while the request holds
        the same image at another index, or none is kept (the cache off)."""
        held = self._inputs.get(request_id)
        if held is None or index not in held:
            return
        held.discard(index)
        if not held:
            del self._inputs[request_id]
        identifier = images[index].identifier
        if any(images[other].identifier == identifier for other in held or ()):
            return
        refs = self._refs.get(identifier)
        if not refs:
            return
        refs.discard(request_id)
        if refs:
            return
        size = self._size[identifier]
        self.num_freeable += size
        if self.keep_unreferenced:
            self._freeable[identifier] = size
        else:
            self._evict(identifier, size)

    def release_all(self, request_id: RequestId, images: Sequence[EncoderInput]) -> None:
        for index in sorted(self.inputs_of(request_id)):
            self.release(request_id, index, images)

    def take_freed(self) -> tuple[str, ...]:
        """The identifiers evicted since the last call, less any allocated again since."""
        freed = tuple(i for i in dict.fromkeys(self._freed) if i not in self._refs)
        self._freed = []
        return freed

    def _evict(self, identifier: str, size: int) -> None:
        del self._refs[identifier], self._size[identifier]
        self._freed.append(identifier)
        self.num_free += size


def plan_images(
    cache: EncoderCacheManager,
    request_id: RequestId,
    images: Sequence[EncoderInput],
    start: int,
    num_new: int,
    budget: int,
) -> tuple[int, list[int], int]:
    """The images a step computing prompt positions [start, start + num_new) needs encoded,
    vLLM's rules: an image its range does not reach, or reaches in no embedding, needs
    nothing; one the cache holds is referenced; any other is encoded if it fits the step's
    encoder `budget` and the cache, and otherwise the step stops before it (num_new cut to
    its offset, 0 when the range starts inside it). Returns (num_new, the images to encode,
    as indices (an image repeated in the prompt is listed again, encoded once), their
    embeddings). The cache keeps the references taken; `allocate_planned` adds the rest once
    the step's KV blocks are allocated, and `release_all` undoes both."""
    end = start + num_new
    encode: list[int] = []
    planned: set[str] = set()
    num_embeds = 0
    for index, image in enumerate(images):
        if image.offset >= end or image.offset + image.length <= start:
            continue
        if image.identifier in planned:
            encode.append(index)
            continue
        if cache.reference(request_id, index, image.identifier):
            continue
        if not embeds_in(image, start, end):
            continue
        size = len(image.embed_positions)
        if not cache.can_allocate(size, budget - num_embeds, num_embeds):
            return max(0, image.offset - start), encode, num_embeds
        planned.add(image.identifier)
        encode.append(index)
        num_embeds += size
    return num_new, encode, num_embeds


def allocate_planned(
    cache: EncoderCacheManager,
    request_id: RequestId,
    images: Sequence[EncoderInput],
    encode: Sequence[int],
) -> None:
    for index in encode:
        image = images[index]
        if not cache.reference(request_id, index, image.identifier):
            cache.allocate(request_id, index, image.identifier, len(image.embed_positions))


def encoder_cache_for(
    max_embeds: int, max_num_batched_tokens: int, size: int | None
) -> tuple[EncoderCacheManager, int]:
    """vLLM's sizing: a step's encoder budget, and the cache, hold the larger of
    --max-num-batched-tokens and the largest image (`max_embeds`) in embeddings; `size`
    (--encoder-cache-size), when given, sizes the cache instead, never below one image (0:
    room for one image, and none stays once no request needs it). Returns (cache, budget)."""
    budget = max(max_num_batched_tokens, max_embeds)
    if size is None:
        return EncoderCacheManager(budget), budget
    return EncoderCacheManager(max(size, max_embeds), keep_unreferenced=size > 0), budget
