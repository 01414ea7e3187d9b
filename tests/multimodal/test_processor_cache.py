"""The processor cache: an image's tiles kept by identifier, the least recently used dropped to
stay within its bytes; queries and hits counted as vLLM's mm_cache_* metrics count them."""

from __future__ import annotations

import pickle

import numpy as np

from blockserve.multimodal.idefics3 import Tiles
from blockserve.multimodal.processor_cache import ProcessorCache


def tiles(value: float, num_tiles: int = 1) -> Tiles:
    return Tiles(np.full((num_tiles, 3, 4, 4), value, dtype=np.float32), 0, 0)  # 192 B a tile


def test_kept_by_identifier_least_recently_used_out() -> None:
    cache = ProcessorCache(capacity_bytes=2 * 192)
    made: list[str] = []

    def process(name: str, value: float) -> Tiles:
        made.append(name)
        return tiles(value)

    assert cache.get("a", lambda: process("a", 1.0)).pixel_values[0, 0, 0, 0] == 1.0
    cache.get("b", lambda: process("b", 2.0))
    assert cache.get("a", lambda: process("a", 9.0)).pixel_values[0, 0, 0, 0] == 1.0  # kept
    cache.get("c", lambda: process("c", 3.0))  # b, the least recently used, goes
    cache.get("b", lambda: process("b", 2.0))
    assert made == ["a", "b", "c", "b"]
    assert (cache.queries, cache.hits, len(cache), cache.used_bytes) == (5, 1, 2, 2 * 192)


def test_an_image_larger_than_the_cache_is_processed_and_not_kept() -> None:
    cache = ProcessorCache(capacity_bytes=192)
    cache.get("big", lambda: tiles(1.0, num_tiles=2))
    assert (len(cache), cache.used_bytes) == (0, 0)


def test_it_travels_to_another_process_empty() -> None:
    """Sent with a replica's front end to the cluster's ingress: its capacity, not its images."""
    cache = ProcessorCache(capacity_bytes=1000)
    cache.get("a", lambda: tiles(1.0))
    copy = pickle.loads(pickle.dumps(cache))
    assert (copy.capacity_bytes, len(copy), copy.used_bytes, copy.queries) == (1000, 0, 0, 0)
    assert copy.get("a", lambda: tiles(2.0)).pixel_values[0, 0, 0, 0] == 2.0
    assert len(copy) == 1
