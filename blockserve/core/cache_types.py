"""What the KV cache manager reads from a request and what its lookups and counters return.

Plain types, kept apart from the manager so that the scheduler, the engine and the replay can
name them without its machinery.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol, TypeAlias

from blockserve.core.free_queue import KVCacheBlock
from blockserve.core.hashing import BlockHash, BlockKeyInputs

RequestId: TypeAlias = Hashable
"""A request's key: any hashable value its owner chooses (the engine uses structured ids)."""


class KVCacheRequest(Protocol):
    """What the manager reads from a request (sched.Request satisfies it)."""

    @property
    def request_id(self) -> RequestId: ...

    @property
    def block_hashes(self) -> Sequence[BlockHash]: ...

    @property
    def all_token_ids(self) -> Sequence[int]: ...

    @property
    def num_tokens(self) -> int: ...

    @property
    def num_computed_tokens(self) -> int: ...

    @property
    def lora_name(self) -> str | None: ...

    @property
    def cache_salt(self) -> str | None: ...

    @property
    def hash_keys(self) -> BlockKeyInputs: ...

    @property
    def skip_reading_prefix_cache(self) -> bool: ...

    @property
    def num_preemptions(self) -> int: ...

    @property
    def priority(self) -> int: ...


class ComputedBlocks(NamedTuple):
    """The result of a prefix-cache lookup: the hit blocks (in order) and the tokens they cover."""

    blocks: tuple[KVCacheBlock, ...]
    num_hit_tokens: int


NO_HIT = ComputedBlocks((), 0)


@dataclass(slots=True)
class PrefixCacheStats:
    """Cumulative prefix-cache counters, in tokens.

    `queries` counts every token of each admitted request (the last included) and `hits` the
    tokens found in the cache. A request re-admitted after preemption re-hits its own blocks;
    that is recomputation avoided, not a cache hit, so it is counted in the `preempted_*` fields.
    """

    requests: int = 0
    queries: int = 0
    hits: int = 0
    preempted_requests: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0
