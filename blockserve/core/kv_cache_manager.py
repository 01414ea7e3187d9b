"""The KV cache manager: the scheduler's only door to the block pool. Owns each request's block
list, prefix-cache lookup, slot allocation (registering full blocks in the cache at schedule
time) and the prefix-cache statistics. Must not touch tensors or make scheduling decisions:
`allocate_slots` answers "does it fit", the scheduler decides what to do."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence

from blockserve.core.block_pool import BlockPool
from blockserve.core.cache_types import (
    NO_HIT,
    ComputedBlocks,
    KVCacheRequest,
    PrefixCacheStats,
    RequestId,
)
from blockserve.core.events import KVEvent, KVEventRecorder
from blockserve.core.eviction import LRU, EvictionConfig
from blockserve.core.explain import CacheExplainer, CacheExplanation
from blockserve.core.free_queue import KVCacheBlock
from blockserve.core.hashing import BlockHash
from blockserve.core.miss_ratio import MissRatioCurve
from blockserve.errors import InvalidRequestError


class KVCacheManager:
    """Allocates KV blocks to requests and finds their cached prefixes.

    A request's blocks are laid out in token order; `num_cached_blocks[id]` of them (a prefix)
    are registered in the prefix cache. Freeing is tail-first (see `BlockPool.free_blocks`).
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        events: KVEventRecorder | None = None,
        eviction: EvictionConfig = LRU,
    ) -> None:
        self.block_pool = BlockPool(
            num_blocks=num_blocks,
            block_size=block_size,
            enable_caching=enable_caching,
            events=events,
            eviction=eviction,
        )
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.req_to_blocks: dict[RequestId, list[KVCacheBlock]] = {}
        self.num_cached_blocks: dict[RequestId, int] = {}
        self.prefix_cache_stats = PrefixCacheStats()
        self.miss_ratio_curve: MissRatioCurve | None = None
        # Remembers the last num_blocks evicted hashes: "evicted" answers within about one
        # turnover of the cache; older evictions read as "never_stored".
        self.explainer = CacheExplainer(block_size, history_size=num_blocks)
        self.block_pool.add_listener(self.explainer)

    def track_miss_ratio(self, curve: MissRatioCurve) -> None:
        """From now on, report every first admission's lookup and every release to `curve`
        (the online miss-ratio curve; off unless called)."""
        self.miss_ratio_curve = curve

    @property
    def usage(self) -> float:
        return self.block_pool.usage

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    def get_computed_blocks(self, request: KVCacheRequest) -> ComputedBlocks:
        """The longest cached prefix of `request`, in whole blocks; mutates nothing.

        Walks the request's block hashes from block 0 and stops at the first miss. The hit is
        capped at `num_tokens - 1`: the last prompt token is always recomputed, because its
        logits are needed to sample. A request that asks for prompt logprobs never reads the
        cache (it needs every position's logits).
        """
        if not self.enable_caching or request.skip_reading_prefix_cache:
            return NO_HIT
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        get_cached_block = self.block_pool.cached_block_hash_to_block.get_one_block
        hits: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[:max_hit_blocks]:
            block = get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return ComputedBlocks(tuple(hits), len(hits) * self.block_size)

    def get_tier_hits(
        self,
        request: KVCacheRequest,
        num_device_blocks: int,
        lookup: Callable[[Sequence[BlockHash]], list[str]],
    ) -> list[str]:
        """Where the blocks after the device hit live below the device: `lookup` names the
        tier of each leading hash it holds. Same rules as `get_computed_blocks` (the last
        token is recomputed; prompt-logprob requests read no cache). Mutates nothing."""
        if not self.enable_caching or request.skip_reading_prefix_cache:
            return []
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        return lookup(request.block_hashes[num_device_blocks:max_hit_blocks])

    def allocate_loading(
        self, request: KVCacheRequest, hit_blocks: Sequence[KVCacheBlock], num_load_blocks: int
    ) -> list[KVCacheBlock] | None:
        """First allocation of a request whose `num_load_blocks` blocks after its device hits
        come from a lower tier: touches the hits and allocates the blocks to load into, which
        stay out of the prefix cache until `finish_loading` (nothing may read them before).
        Returns the blocks to load into; None, mutating nothing, when they do not fit."""
        assert request.request_id not in self.req_to_blocks, "loading is a first allocation"
        num_evictable_hits = sum(1 for block in hit_blocks if block.ref_cnt == 0)
        if num_load_blocks + num_evictable_hits > self.block_pool.num_free_blocks:
            return None
        self.block_pool.touch(hit_blocks)
        new_blocks = self.block_pool.get_new_blocks(num_load_blocks)
        self.req_to_blocks[request.request_id] = [*hit_blocks, *new_blocks]
        self.num_cached_blocks[request.request_id] = len(hit_blocks)
        return new_blocks

    def finish_loading(self, request: KVCacheRequest, num_loaded_blocks: int) -> int:
        """Cache the first `num_loaded_blocks` loaded blocks (a failed load stops early: the
        blocks after it are computed like any others) and count the admission. Returns the
        request's hit in tokens, device and loaded blocks together."""
        request_id = request.request_id
        num_cached = self.num_cached_blocks[request_id]
        num_hit_blocks = num_cached + num_loaded_blocks
        blocks = self.req_to_blocks[request_id]
        self.block_pool.cache_full_blocks(request, blocks, num_cached, num_hit_blocks)
        self.num_cached_blocks[request_id] = num_hit_blocks
        self._record_admission(request, num_hit_blocks * self.block_size)
        return num_hit_blocks * self.block_size

    def explain(self, request: KVCacheRequest, num_hit_tokens: int) -> CacheExplanation:
        """Why `request`'s lookup found exactly `num_hit_tokens` (from `get_computed_blocks`):
        the first block not served and one reason. Call it before allocating the request's
        slots, which stores its own blocks. Mutates nothing."""
        num_hit_blocks = num_hit_tokens // self.block_size
        if not self.enable_caching or request.skip_reading_prefix_cache:
            return CacheExplanation(num_hit_blocks, "caching_disabled")
        return self.explainer.explain(
            request.block_hashes,
            request.all_token_ids,
            num_hit_blocks,
            self.block_pool.cached_block_hash_to_block.__contains__,
            request.cache_salt,
            [(image.offset, image.length) for image in request.hash_keys.mm_features],
        )

    def allocate_slots(
        self,
        request: KVCacheRequest,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: Sequence[KVCacheBlock] = (),
    ) -> list[KVCacheBlock] | None:
        """Give `request` room for `num_new_tokens` more tokens; None if they do not fit.

        Token layout of the request after this call:

            |<- num_computed_tokens ->|<- num_new_computed_tokens ->|<- num_new_tokens ->|
            |  already in its blocks  |  prefix hits (first call)   |  to compute now    |
            |<------------------------- ceil(total / block_size) blocks --------------->|

        `new_computed_blocks` (from `get_computed_blocks`, first call only) are touched and
        become the request's first blocks. Returns the newly allocated blocks. Returns None, and
        mutates nothing, when the new blocks plus the hit blocks that are now free (touching
        takes them out of the free queue) exceed the free blocks. Every block that becomes
        full is registered in the prefix cache now, at schedule time, so a request admitted
        later in the same step can hit it.
        """
        if num_new_tokens <= 0:
            raise InvalidRequestError(f"num_new_tokens must be positive, got {num_new_tokens}")
        request_id = request.request_id
        req_blocks = self.req_to_blocks.get(request_id)
        if new_computed_blocks and req_blocks:
            raise InvalidRequestError(
                f"request {request_id!r} already holds blocks; prefix hits apply to its first "
                "allocation only"
            )
        num_held = len(req_blocks) if req_blocks is not None else 0
        num_computed = request.num_computed_tokens + num_new_computed_tokens
        num_total = num_computed + num_new_tokens
        num_required = -(-num_total // self.block_size)
        num_new_blocks = max(num_required - num_held - len(new_computed_blocks), 0)
        num_evictable_hits = sum(1 for block in new_computed_blocks if block.ref_cnt == 0)
        if num_new_blocks + num_evictable_hits > self.block_pool.num_free_blocks:
            return None

        if req_blocks is None:
            req_blocks = self.req_to_blocks[request_id] = []
            self.num_cached_blocks[request_id] = len(new_computed_blocks)
            self._record_admission(request, num_new_computed_tokens)
        if new_computed_blocks:
            self.block_pool.touch(new_computed_blocks)
            req_blocks.extend(new_computed_blocks)
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks) if num_new_blocks else []
        req_blocks.extend(new_blocks)

        if self.enable_caching:
            # Cap at the request's real tokens: only blocks whose tokens are known are hashed.
            num_full_blocks = min(num_total, request.num_tokens) // self.block_size
            num_cached = self.num_cached_blocks[request_id]
            if num_full_blocks > num_cached:
                self.block_pool.cache_full_blocks(request, req_blocks, num_cached, num_full_blocks)
                self.num_cached_blocks[request_id] = num_full_blocks
        return new_blocks

    def _record_admission(self, request: KVCacheRequest, num_hit_tokens: int) -> None:
        if not self.enable_caching:
            return
        stats = self.prefix_cache_stats
        if request.num_preemptions > 0:
            stats.preempted_requests += 1
            stats.preempted_queries += request.num_tokens
            stats.preempted_hits += num_hit_tokens
        else:
            stats.requests += 1
            stats.queries += request.num_tokens
            stats.hits += num_hit_tokens
            if self.miss_ratio_curve is not None:
                hashes = () if request.skip_reading_prefix_cache else request.block_hashes
                self.miss_ratio_curve.record_lookup(hashes, request.num_tokens)

    def free(self, request: KVCacheRequest) -> None:
        """Release the request's blocks, tail-first; they stay cached until evicted.

        A request holding no blocks (aborted before allocation, or already freed) is a no-op.
        """
        blocks = self.req_to_blocks.pop(request.request_id, None)
        num_cached = self.num_cached_blocks.pop(request.request_id, 0)
        if blocks:
            self.block_pool.free_blocks(reversed(blocks), request.priority, request.num_tokens)
        if self.miss_ratio_curve is not None and num_cached:
            self.miss_ratio_curve.record_release(request.block_hashes[:num_cached])

    def get_block_ids(self, request_id: RequestId) -> list[int]:
        """The request's block table (block ids in token order); empty when it holds none."""
        return [block.block_id for block in self.req_to_blocks.get(request_id, ())]

    def reset_prefix_cache(self) -> bool:
        """Clear the prefix cache; False while any request holds blocks."""
        if not self.block_pool.reset_prefix_cache():
            return False
        if self.miss_ratio_curve is not None:
            self.miss_ratio_curve.forget_blocks()
        return True

    def integrity_errors(self) -> list[str]:
        """Pool invariants, plus: every block's ref_cnt equals the requests holding it."""
        errors = self.block_pool.integrity_errors()
        holders = Counter(b.block_id for blocks in self.req_to_blocks.values() for b in blocks)
        for block in self.block_pool.blocks[1:]:
            if block.ref_cnt != holders.get(block.block_id, 0):
                errors.append(
                    f"block {block.block_id}: ref_cnt {block.ref_cnt}, "
                    f"held by {holders.get(block.block_id, 0)} requests"
                )
        if set(self.num_cached_blocks) != set(self.req_to_blocks):
            errors.append("cached-block counts and block lists name different requests")
        return errors

    def take_events(self) -> list[KVEvent]:
        """Drain the KV events emitted since the last call."""
        return self.block_pool.take_events()
