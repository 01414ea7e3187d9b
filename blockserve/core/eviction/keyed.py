"""Policies that order free cached blocks by a key, least recently freed first among equals."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

from blockserve.core.eviction.base import HitTracking
from blockserve.core.free_queue import KVCacheBlock


@dataclass(frozen=True, slots=True)
class TailLRUConfig:
    """T-LRU's two numbers, in tokens: `threshold_tokens` (xi) is the prefill a turn may pay
    within its TTFT budget, `next_prompt_tokens` (q) the expected length of a next turn."""

    threshold_tokens: int = 512
    next_prompt_tokens: int = 128


class KeyedPolicy(HitTracking):
    """Smallest `_key(block)` first, taken when the block is freed; ties by least recently
    freed, so a request's deeper block first.

    - `lfu` — fewest hits first.
    - `priority` — the block of the least urgent request first: a freed block carries the
      `priority` of the request that last let go of it, and the largest value (the scheduler serves
      small values first) is evicted first.
    - `tlru` — Tail-Optimized LRU (Zhang, Li, Moallemi and Peng, "Tail-Optimized Caching for LLM
      Inference", arXiv:2510.15152). A conversation of L tokens whose next turn adds about q tokens
      needs only its first L + q - xi tokens cached to keep that turn's uncached prefill within xi
      tokens (the TTFT budget); blocks past that point cannot lift its tail latency, so they are
      evicted first (all of a short conversation's blocks, the tail of a long one's), in LRU order,
      and LRU takes over when none is left.
    """

    def __init__(self, blocks: Sequence[KVCacheBlock], num_blocks: int) -> None:
        super().__init__(blocks, num_blocks)
        self._heap: list[tuple[int, int, int]] = []  # (key, free order, block id)
        self._entry: dict[int, tuple[int, int, int]] = {}  # live entry per free cached block
        self._blocks: dict[int, KVCacheBlock] = {}
        self._order = itertools.count()

    def _key(self, block: KVCacheBlock) -> int:
        raise NotImplementedError

    def append_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        for block in blocks:
            entry = (self._key(block), next(self._order), block.block_id)
            heapq.heappush(self._heap, entry)
            self._entry[block.block_id] = entry
            self._blocks[block.block_id] = block
            self._num_cached_free += 1

    def _pop_cached(self) -> KVCacheBlock:
        while True:
            entry = heapq.heappop(self._heap)
            if self._entry.get(entry[2]) is entry:  # skip entries of blocks hit since
                del self._entry[entry[2]]
                self._num_cached_free -= 1
                return self._blocks.pop(entry[2])

    def _remove_cached(self, block: KVCacheBlock) -> None:
        del self._entry[block.block_id]
        del self._blocks[block.block_id]
        self._num_cached_free -= 1

    def __iter__(self) -> Iterator[KVCacheBlock]:
        yield from self.unhashed
        for entry in sorted(self._entry.values()):
            yield self._blocks[entry[2]]


class LFUPolicy(KeyedPolicy):
    """Fewest hits first."""

    def _key(self, block: KVCacheBlock) -> int:
        return self.hits[block.block_id]


class PriorityPolicy(KeyedPolicy):
    """The largest `priority` value of the request that last let go of the block first."""

    def __init__(self, blocks: Sequence[KVCacheBlock], num_blocks: int) -> None:
        super().__init__(blocks, num_blocks)
        self.freed_priority = [0] * num_blocks

    def on_freed(self, blocks: Sequence[KVCacheBlock], priority: int, num_tokens: int) -> None:
        for block in blocks:
            self.freed_priority[block.block_id] = priority

    def _key(self, block: KVCacheBlock) -> int:
        return -self.freed_priority[block.block_id]


class TailLRUPolicy(KeyedPolicy):
    """Blocks past their conversation's T-LRU budget first, then the rest (both LRU)."""

    def __init__(
        self,
        blocks: Sequence[KVCacheBlock],
        num_blocks: int,
        block_size: int,
        config: TailLRUConfig,
    ) -> None:
        super().__init__(blocks, num_blocks)
        self.block_size = block_size
        self.config = config
        self.needed = [True] * num_blocks  # False: past its conversation's T-LRU budget

    def on_freed(self, blocks: Sequence[KVCacheBlock], priority: int, num_tokens: int) -> None:
        config = self.config
        keep_tokens = max(0, num_tokens + config.next_prompt_tokens - config.threshold_tokens)
        last = len(blocks) - 1
        for k, block in enumerate(blocks):  # tail-first: block `last - k` of the request
            self.needed[block.block_id] = (last - k) * self.block_size < keep_tokens

    def _key(self, block: KVCacheBlock) -> int:
        return int(self.needed[block.block_id])
