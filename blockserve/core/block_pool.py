"""The block pool: every physical KV block, its reference count, and the prefix-cache map. Owns
allocation (with lazy eviction of cached blocks), reference counting, the hash→block map and the
KV events those changes produce. Must not know about scheduling or request text; it sees a
request only through `CacheableRequest` when registering its full blocks."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

from blockserve.core.block_hash_map import BlockHashToBlockMap
from blockserve.core.events import CacheListener, KVEvent, KVEventRecorder
from blockserve.core.eviction import LRU, EvictionConfig, HitAwarePolicy
from blockserve.core.free_queue import FreeBlockQueue, KVCacheBlock
from blockserve.core.hashing import BlockHash, BlockKeyInputs
from blockserve.errors import InvalidConfigError, NoFreeBlocksError


class CacheableRequest(Protocol):
    """What the pool reads from a request when it registers the request's full blocks."""

    @property
    def block_hashes(self) -> Sequence[BlockHash]: ...

    @property
    def all_token_ids(self) -> Sequence[int]: ...

    @property
    def lora_name(self) -> str | None: ...

    @property
    def cache_salt(self) -> str | None: ...

    @property
    def hash_keys(self) -> BlockKeyInputs: ...


class BlockPool:
    """All KV blocks of one cache, handed out and taken back by reference count.

    Invariants:
    - Block 0 is the null block: never handed out, freed, cached or evicted, so N blocks give
      N-1 usable ones.
    - A block is in the free queue exactly when its `ref_cnt` is 0.
    - Every hash-map entry points at a block carrying that hash, and every hashed block is in
      the map. Free blocks keep their hash (they are cache entries) until handed out again:
      eviction is lazy and emits `BlockRemoved` when the last block of a hash goes.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        events: KVEventRecorder | None = None,
        eviction: EvictionConfig = LRU,
    ) -> None:
        if not isinstance(num_blocks, int) or isinstance(num_blocks, bool) or num_blocks < 2:
            raise InvalidConfigError(f"num_blocks must be an integer >= 2, got {num_blocks!r}")
        if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size <= 0:
            raise InvalidConfigError(f"block_size must be a positive integer, got {block_size!r}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.events = events
        self.blocks = [KVCacheBlock(block_id=i) for i in range(num_blocks)]
        self.null_block = self.blocks[0]
        self.null_block.is_null = True
        self.free_block_queue = eviction.create(self.blocks[1:], num_blocks, block_size)
        # LRU needs no notifications: its order is the free queue itself, untouched and fast.
        self._hooks: HitAwarePolicy | None = (
            None if isinstance(self.free_block_queue, FreeBlockQueue) else self.free_block_queue
        )
        self.cached_block_hash_to_block = BlockHashToBlockMap()
        self.num_evictions = 0  # cached blocks handed out again (their hash dropped)
        self._listeners: list[CacheListener] = []

    def add_listener(self, listener: CacheListener) -> None:
        """Tell `listener` of every hash stored or removed from now on, and of resets."""
        self._listeners.append(listener)

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        """Blocks with no holder, cached ones included (they can be evicted at any time)."""
        return self.free_block_queue.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of usable blocks held by requests: `1 - free / (N - 1)`."""
        return 1.0 - self.num_free_blocks / self.num_usable_blocks

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        """A block caching `block_hash`, or None; changes nothing (see `touch`)."""
        return self.cached_block_hash_to_block.get_one_block(block_hash)

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take `num_blocks` blocks from the head of the free queue, each with `ref_cnt = 1`.

        A cached block taken here is evicted: its hash is dropped from the map (emitting
        `BlockRemoved` when no other block holds that hash). Raises `NoFreeBlocksError`, with
        nothing changed, when fewer blocks are free.
        """
        if num_blocks > self.free_block_queue.num_free_blocks:
            raise NoFreeBlocksError(
                f"asked for {num_blocks} blocks, {self.free_block_queue.num_free_blocks} free"
            )
        blocks = self.free_block_queue.popleft_n(num_blocks)
        for block in blocks:
            assert block.ref_cnt == 0, f"free block {block.block_id} is held"
            if block.block_hash is not None:
                self._evict(block)
            block.ref_cnt = 1
        return blocks

    def _evict(self, block: KVCacheBlock) -> None:
        block_hash = block.block_hash
        assert block_hash is not None
        block.block_hash = None
        self.num_evictions += 1
        if self._hooks is not None:
            self._hooks.on_evicted(block_hash)
        hash_gone = self.cached_block_hash_to_block.pop(block_hash, block.block_id)
        if not hash_gone:
            return
        if self.events is not None:
            self.events.block_removed(block_hash)
        for listener in self._listeners:
            listener.on_hash_removed(block_hash)

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on each block (a prefix hit); free ones leave the free queue."""
        queue = self.free_block_queue
        hooks = self._hooks
        for block in blocks:
            if block.is_null:
                continue
            if hooks is not None:
                hooks.record_hit(block)
            if block.ref_cnt == 0:
                queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(
        self, ordered_blocks: Iterable[KVCacheBlock], priority: int = 0, num_tokens: int = 0
    ) -> None:
        """Drop one reference on each block; blocks reaching 0 return to the free queue.

        Unhashed blocks (which cache nothing) go to the head, to be reused first; hashed blocks
        go to the tail, in the order given, so callers pass a request's blocks tail-first and
        its deepest block is evicted first. `priority` and `num_tokens` describe the request
        letting go, for the policies that order by it (`priority`, `tlru`).
        """
        if self._hooks is not None:
            ordered_blocks = list(ordered_blocks)
            self._hooks.on_freed(ordered_blocks, priority, num_tokens)
        unhashed: list[KVCacheBlock] = []
        hashed: list[KVCacheBlock] = []
        for block in ordered_blocks:
            if block.is_null:
                continue
            block.ref_cnt -= 1
            assert block.ref_cnt >= 0, f"block {block.block_id} freed more often than held"
            if block.ref_cnt == 0:
                (unhashed if block.block_hash is None else hashed).append(block)
        if unhashed:
            self.free_block_queue.prepend_n(unhashed)
        if hashed:
            self.free_block_queue.append_n(hashed)

    def cache_full_blocks(
        self,
        request: CacheableRequest,
        blocks: Sequence[KVCacheBlock],
        num_cached_blocks: int,
        num_full_blocks: int,
    ) -> None:
        """Register `blocks[num_cached_blocks:num_full_blocks]` under the request's hashes.

        The blocks must not be cached yet. Emits one `BlockStored` covering them, whose parent
        is the hash of block `num_cached_blocks - 1` (None for block 0).
        """
        if not self.enable_caching or num_full_blocks <= num_cached_blocks:
            return
        block_hashes = request.block_hashes
        assert len(block_hashes) >= num_full_blocks, "request hashes lag behind its tokens"
        new_hashes = block_hashes[num_cached_blocks:num_full_blocks]
        cache_map = self.cached_block_hash_to_block
        new_blocks = blocks[num_cached_blocks:num_full_blocks]
        for block, block_hash in zip(new_blocks, new_hashes, strict=True):
            assert block.block_hash is None, f"block {block.block_id} is already cached"
            block.block_hash = block_hash
            cache_map.insert(block_hash, block)
            if self._hooks is not None:
                self._hooks.on_cached(block)
        if self.events is None and not self._listeners:
            return
        size = self.block_size
        parent = block_hashes[num_cached_blocks - 1] if num_cached_blocks else None
        token_ids = request.all_token_ids[num_cached_blocks * size : num_full_blocks * size]
        for listener in self._listeners:
            listener.on_hashes_stored(new_hashes, parent, token_ids, request.cache_salt)
        if self.events is not None:
            extra_keys = request.hash_keys.event_extra_keys(
                num_cached_blocks, num_full_blocks, size
            )
            self.events.block_stored(
                new_hashes, parent, list(token_ids), size, request.lora_name, extra_keys
            )

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; False, with nothing changed, while any block is held.

        On success emits `AllBlocksCleared`, and the next request gets no hits.
        """
        if self.num_free_blocks != self.num_usable_blocks:
            return False
        self.cached_block_hash_to_block.clear()
        for block in self.blocks:
            block.block_hash = None
        if self._hooks is not None:
            self._hooks.on_reset()
        for listener in self._listeners:
            listener.on_cache_cleared()
        if self.events is not None:
            self.events.all_blocks_cleared()
        return True

    def take_events(self) -> list[KVEvent]:
        """Drain the events emitted since the last call (empty when events are off)."""
        return self.events.take() if self.events is not None else []

    def integrity_errors(self) -> list[str]:
        """Every broken invariant (empty when sound): each block free with ref_cnt 0 or held,
        the free count equal to the queue's length, and the hash map and the blocks' hashes
        describing the same (hash, block) pairs. O(num_blocks): for tests and debugging."""
        errors = []
        free_ids = self.free_block_queue.block_ids()
        free = set(free_ids)
        if len(free) != len(free_ids) or len(free_ids) != self.num_free_blocks:
            errors.append(
                f"free queue has {len(free_ids)} entries ({len(free)} distinct), "
                f"count says {self.num_free_blocks}"
            )
        null = self.null_block
        if null.block_id != 0 or not null.is_null or null.block_hash is not None or 0 in free:
            errors.append("the null block is not block 0, or is hashed or queued")
        for block in self.blocks[1:]:
            if block.is_null:
                errors.append(f"block {block.block_id} is marked null")
            if (block.block_id in free) != (block.ref_cnt == 0):
                errors.append(
                    f"block {block.block_id}: ref_cnt {block.ref_cnt}, "
                    f"{'in' if block.block_id in free else 'not in'} the free queue"
                )
        mapped: dict[int, bytes] = {}
        for block_hash, block in self.cached_block_hash_to_block.items():
            if block.block_hash != block_hash or block.block_id in mapped:
                errors.append(f"hash map entry for block {block.block_id} is wrong")
            mapped[block.block_id] = block_hash
        hashed = {b.block_id: b.block_hash for b in self.blocks if b.block_hash is not None}
        if mapped != hashed:
            errors.append(f"{len(hashed)} hashed blocks but {len(mapped)} hash map entries")
        return errors
