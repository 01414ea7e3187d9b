"""The processor cache (vLLM's `--mm-processor-cache-gb`): an image's tiles, as its processing
made them, kept by the image's identifier, so that an image sent again is not decoded, resized
and normalised again. Least recently used first out, bounded in bytes; safe across threads."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable

from blockserve.multimodal.idefics3 import Tiles


class ProcessorCache:
    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self.used_bytes = 0
        self.queries = 0  # vLLM's mm_cache_queries: items looked up
        self.hits = 0  # vLLM's mm_cache_hits: items found
        self._tiles: OrderedDict[str, Tiles] = OrderedDict()
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, int]:
        """Pickled (sent to another process), the cache travels empty, its capacity alone."""
        return {"capacity_bytes": self.capacity_bytes}

    def __setstate__(self, state: dict[str, int]) -> None:
        self.__init__(state["capacity_bytes"])  # type: ignore[misc]

    def __len__(self) -> int:
        return len(self._tiles)

    def get(self, identifier: str, process: Callable[[], Tiles]) -> Tiles:
        """The tiles kept for `identifier`, else `process()`'s, kept (unless larger than the
        whole cache), the least recently used dropped to make room."""
        with self._lock:
            self.queries += 1
            tiles = self._tiles.get(identifier)
            if tiles is not None:
                self.hits += 1
                self._tiles.move_to_end(identifier)
                return tiles
        tiles = process()  # outside the lock: other threads' images are processed meanwhile
        size = tiles.pixel_values.nbytes
        with self._lock:
            if size > self.capacity_bytes or identifier in self._tiles:
                return tiles
            while self.used_bytes + size > self.capacity_bytes:
                _, dropped = self._tiles.popitem(last=False)
                self.used_bytes -= dropped.pixel_values.nbytes
            self._tiles[identifier] = tiles
            self.used_bytes += size
        return tiles
