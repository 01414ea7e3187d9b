"""Eviction policies: which free cached block the pool hands out (and so evicts) next. A policy owns
the free blocks' order. Every policy keeps the pool's invariants: only free blocks (ref_cnt 0)
are ever handed out, unhashed free blocks go before any cached one, and among blocks freed
together (a request's, tail-first) the deeper block goes first on ties.

Modules:

  base.py       the policy protocol and what the hit-aware policies share
  keyed.py      lfu, priority, tlru: smallest key first
  segmented.py  slru, ghost: a probationary and a protected segment
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from blockserve.core.eviction.base import FreeBlockPolicy, HitAwarePolicy, HitTracking
from blockserve.core.eviction.keyed import (
    KeyedPolicy,
    LFUPolicy,
    PriorityPolicy,
    TailLRUConfig,
    TailLRUPolicy,
)
from blockserve.core.eviction.segmented import GhostPolicy, SegmentedLRUPolicy
from blockserve.core.free_queue import FreeBlockQueue, KVCacheBlock
from blockserve.errors import InvalidConfigError

# - `lru` — `FreeBlockQueue` itself: least recently freed first. The default, and no slower.
# - `lfu`, `priority`, `tlru` — ordered by a key (keyed.py): fewest hits; the least urgent
#   request's blocks; Tail-Optimized LRU's blocks that cannot help a next turn's tail latency.
# - `slru` — segmented LRU: blocks never hit since cached sit in a probationary segment and go
#   first; blocks hit at least once sit in a protected segment (at most 80% of the pool).
# - `ghost` — blockserve's admission-aware policy for traces where most blocks are used once:
#   like slru, a new block waits in probation and is evicted before any block that was hit; the
#   hashes of recently evicted blocks are remembered (a ghost list as long as the pool), and a
#   block cached again under a remembered hash — it came back — enters protected directly.

EVICTION_POLICIES = ("lru", "lfu", "slru", "ghost", "priority", "tlru")

__all__ = [
    "EVICTION_POLICIES",
    "LRU",
    "EvictionConfig",
    "FreeBlockPolicy",
    "GhostPolicy",
    "HitAwarePolicy",
    "HitTracking",
    "KeyedPolicy",
    "LFUPolicy",
    "PriorityPolicy",
    "SegmentedLRUPolicy",
    "TailLRUConfig",
    "TailLRUPolicy",
    "create_free_block_policy",
]


@dataclass(frozen=True, slots=True)
class EvictionConfig:
    """Which eviction policy a pool runs (one of EVICTION_POLICIES), with `tlru`'s numbers."""

    policy: str = "lru"
    tlru: TailLRUConfig = field(default_factory=TailLRUConfig)

    def create(
        self, blocks: Sequence[KVCacheBlock], num_blocks: int, block_size: int
    ) -> FreeBlockQueue | HitAwarePolicy:
        """The policy over the initially free `blocks` (ids < num_blocks)."""
        return create_free_block_policy(self.policy, blocks, num_blocks, block_size, self.tlru)


LRU = EvictionConfig()  # the default


def create_free_block_policy(
    name: str,
    blocks: Sequence[KVCacheBlock],
    num_blocks: int,
    block_size: int = 16,
    tlru: TailLRUConfig | None = None,
) -> FreeBlockQueue | HitAwarePolicy:
    """The policy `name` over the initially free `blocks` (ids < num_blocks)."""
    if name == "lru":
        return FreeBlockQueue(blocks)
    if name == "lfu":
        return LFUPolicy(blocks, num_blocks)
    if name == "slru":
        return SegmentedLRUPolicy(blocks, num_blocks)
    if name == "ghost":
        return GhostPolicy(blocks, num_blocks)
    if name == "priority":
        return PriorityPolicy(blocks, num_blocks)
    if name == "tlru":
        return TailLRUPolicy(
            blocks=blocks,
            num_blocks=num_blocks,
            block_size=block_size,
            config=tlru or TailLRUConfig(),
        )
    raise InvalidConfigError(
        f"unknown eviction policy {name!r}; choose one of {', '.join(EVICTION_POLICIES)}"
    )
