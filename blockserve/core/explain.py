"""Why a request's prefix-cache match stopped where it did: one reason per request that asks. Owns a
bounded history of recently evicted hashes and an index of the token content of cached first
blocks, both kept from the pool's listener calls (O(1) per eviction, one small hash per stored
chain). Must not change the cache; the diagnosis itself runs only for requests that ask."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from blockserve.core.hashing import BlockHash

REASONS = (
    "never_stored",  # the block's hash was not in the cache, nor evicted recently
    "evicted",  # it was cached and evicted `evicted_seconds_ago`
    "image",  # never stored, and an image's span touches it: another image, or another offset
    "other_namespace",  # unsalted: the same tokens are cached, unsalted, for another LoRA
    "partial_block",  # every full block hit; the rest is a partial block, never cached
    "last_token",  # every block it may hit did; the last token is always recomputed
    "caching_disabled",  # prefix caching is off, or this request does not read the cache
)


@dataclass(frozen=True, slots=True)
class CacheExplanation:
    """Where the match stopped: `first_missing_block` is the index of the first block not
    served from the cache (= cached tokens / block size), `reason` one of REASONS."""

    first_missing_block: int
    reason: str
    evicted_seconds_ago: float | None = None


class CacheExplainer:
    """Listens to the pool (a `CacheListener`) and explains misses on demand.

    Only the first block can miss because of a namespace: `cache_salt` and the LoRA name are
    hashed into block 0, and every deeper hash chains from it. So the content index covers
    first blocks only: token tuple -> number of cached first-block hashes holding it.

    A salt separates tenants, so the index holds unsalted blocks only and answers unsalted
    requests only: no request learns whether a salted namespace, its own or another's,
    holds some tokens (a salted request that misses reads `never_stored`).
    """

    def __init__(
        self,
        block_size: int,
        history_size: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.block_size = block_size
        self.history_size = history_size
        self.clock = clock  # public: tests set it to read exact ages
        self._evicted: OrderedDict[BlockHash, float] = OrderedDict()  # hash -> when
        self._first_blocks: dict[BlockHash, tuple[int, ...]] = {}  # cached hash -> its tokens
        self._first_block_contents: dict[tuple[int, ...], int] = {}

    def explain(
        self,
        block_hashes: Sequence[BlockHash],
        token_ids: Sequence[int],
        num_hit_blocks: int,
        is_cached: Callable[[BlockHash], bool],
        cache_salt: str | None = None,
        image_spans: Sequence[tuple[int, int]] = (),
    ) -> CacheExplanation:
        """Why a prompt of `token_ids` (full-block hashes `block_hashes`, images at
        `image_spans`, each (offset, length)) matched exactly `num_hit_blocks` blocks. Call it
        before the request's own blocks are stored."""
        num_tokens = len(token_ids)
        max_hit_blocks = (num_tokens - 1) // self.block_size
        if num_hit_blocks >= max_hit_blocks:
            # The binding rule: a full last block holds the last token, which is recomputed.
            full_last_block = max_hit_blocks < num_tokens // self.block_size
            return CacheExplanation(
                num_hit_blocks, "last_token" if full_last_block else "partial_block"
            )
        missing = block_hashes[num_hit_blocks]
        assert not is_cached(missing), "the match stopped at a cached block"
        evicted_at = self._evicted.get(missing)
        if evicted_at is not None:
            seconds = round(self.clock() - evicted_at, 3)
            return CacheExplanation(num_hit_blocks, "evicted", seconds)
        start, end = num_hit_blocks * self.block_size, (num_hit_blocks + 1) * self.block_size
        if any(offset < end and start < offset + length for offset, length in image_spans):
            return CacheExplanation(num_hit_blocks, "image")
        if num_hit_blocks == 0 and cache_salt is None:
            content = tuple(token_ids[: self.block_size])
            if self._first_block_contents.get(content, 0) > 0:
                return CacheExplanation(0, "other_namespace")
        return CacheExplanation(num_hit_blocks, "never_stored")

    # -- CacheListener --------------------------------------------------------------------

    def on_hashes_stored(
        self,
        block_hashes: Sequence[BlockHash],
        parent_block_hash: BlockHash | None,
        token_ids: Sequence[int],
        cache_salt: str | None,
    ) -> None:
        for block_hash in block_hashes:
            self._evicted.pop(block_hash, None)  # cached again: no longer "evicted"
        first = parent_block_hash is None and block_hashes
        if first and cache_salt is None and block_hashes[0] not in self._first_blocks:
            content = tuple(token_ids[: self.block_size])
            self._first_blocks[block_hashes[0]] = content
            self._first_block_contents[content] = self._first_block_contents.get(content, 0) + 1

    def on_hash_removed(self, block_hash: BlockHash) -> None:
        self._evicted[block_hash] = self.clock()
        self._evicted.move_to_end(block_hash)
        if len(self._evicted) > self.history_size:
            self._evicted.popitem(last=False)
        content = self._first_blocks.pop(block_hash, None)
        if content is not None:
            count = self._first_block_contents[content] - 1
            if count:
                self._first_block_contents[content] = count
            else:
                del self._first_block_contents[content]

    def on_cache_cleared(self) -> None:
        """A reset is not an eviction: the history and the content index start over."""
        self._evicted.clear()
        self._first_blocks.clear()
        self._first_block_contents.clear()
