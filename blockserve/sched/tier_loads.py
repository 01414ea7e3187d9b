"""Requests whose cached prefix continues below the device: admitted LOADING those blocks."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Sequence
from typing import Protocol

from blockserve.core.cache_types import RequestId
from blockserve.core.free_queue import KVCacheBlock
from blockserve.core.hashing import BlockHash, tier_key
from blockserve.core.kv_cache_manager import KVCacheManager
from blockserve.sched.request import Request, RequestStatus


class TierLoader(Protocol):
    """The KV tiers below the device, as the scheduler drives them (kv_tiers/offload.py)."""

    def lookup(self, block_hashes: Sequence[BlockHash]) -> list[str]:
        """The tier holding each leading hash, up to the first that no tier holds."""
        ...

    def start_load(
        self, request_id: RequestId, block_hashes: Sequence[BlockHash], block_ids: Sequence[int]
    ) -> None:
        """Load those blocks into those device blocks, in the background."""
        ...

    def finished_loads(self) -> dict[RequestId, int]:
        """Loads finished since the last call: how many leading blocks each loaded."""
        ...

    def cancel_load(self, request_id: RequestId) -> None:
        """Stop a load; returns once nothing writes into its device blocks any more."""
        ...


class TierLoads:
    """The LOADING requests, with the tier of each block they load.

    A request whose device hit is followed by blocks that a lower tier (host memory, disk) holds
    is given device blocks for them at once and waits, taking no token budget, while the tiers
    copy the blocks in the background; other requests keep running. When the load ends, the
    loaded blocks join the prefix cache as ordinary cached blocks and the request runs from the
    first block not loaded: a failed load costs computation, never wrong KV. Imports no torch.
    """

    def __init__(self, tiers: TierLoader, kv_cache_manager: KVCacheManager) -> None:
        self.tiers = tiers
        self.kv_cache_manager = kv_cache_manager
        self._loading: dict[RequestId, tuple[Request, list[str]]] = {}

    def __len__(self) -> int:
        return len(self._loading)

    def requests(self) -> Iterator[Request]:
        return (request for request, _ in self._loading.values())

    def lookup(self, request: Request, num_device_blocks: int) -> list[str]:
        """The tiers of the blocks after the request's device hit (empty: nothing to load)."""
        identity = request.tier_identity
        if identity is None:  # a block's key below the device is its hash
            return self.kv_cache_manager.get_tier_hits(
                request, num_device_blocks, self.tiers.lookup
            )

        def lookup(hashes: Sequence[BlockHash]) -> list[str]:
            return self.tiers.lookup([tier_key(h, identity) for h in hashes])

        return self.kv_cache_manager.get_tier_hits(request, num_device_blocks, lookup)

    def start(
        self, request: Request, hit_blocks: Sequence[KVCacheBlock], tier_hits: list[str]
    ) -> bool:
        """Allocate the request's hit and load blocks and start the load; False, changing
        nothing, when the blocks do not fit."""
        manager = self.kv_cache_manager
        num_hits = len(hit_blocks) * manager.block_size
        explanation = None
        if request.num_cached_tokens is None and request.explain_cache:
            # Explained before allocating, as at any admission, over the hit it will have.
            explanation = manager.explain(request, num_hits + len(tier_hits) * manager.block_size)
        blocks = manager.allocate_loading(request, hit_blocks, len(tier_hits))
        if blocks is None:
            return False
        if request.num_cached_tokens is None:
            request.cache_explanation = explanation
        request.status = RequestStatus.LOADING
        request.num_computed_tokens = num_hits
        self._loading[request.request_id] = (request, tier_hits)
        first = len(hit_blocks)
        hashes = request.block_hashes[first : first + len(tier_hits)]
        keys = [tier_key(h, request.tier_identity) for h in hashes]
        self.tiers.start_load(request.request_id, keys, [b.block_id for b in blocks])
        return True

    def finish(self) -> list[Request]:
        """The requests whose load ended, RUNNING now with their loaded blocks cached."""
        if not self._loading:
            return []
        ready = []
        size = self.kv_cache_manager.block_size
        for request_id, num_loaded in self.tiers.finished_loads().items():
            entry = self._loading.pop(request_id, None)
            if entry is None:
                continue  # cancelled meanwhile
            request, tiers = entry
            num_hits = self.kv_cache_manager.finish_loading(request, num_loaded)
            request.num_computed_tokens = num_hits
            if request.num_cached_tokens is None:
                request.num_cached_tokens = num_hits
                counts = Counter(tiers[:num_loaded])
                request.tier_cached_tokens = {tier: n * size for tier, n in counts.items()}
            request.status = RequestStatus.RUNNING
            ready.append(request)
        return ready

    def cancel(self, request: Request) -> None:
        """Stop the request's load; its blocks may be freed once this returns."""
        self.tiers.cancel_load(request.request_id)
        del self._loading[request.request_id]
