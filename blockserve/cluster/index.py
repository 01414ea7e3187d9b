"""`PrefixIndex`: what one replica holds in its prefix cache, as a router sees it."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

import msgspec

from blockserve.core.events import MEDIUM_REMOTE, ExternalBlockHash, KVEventBatch
from blockserve.events.subscriber import CacheMirror

DEFAULT_CREDIT_TTL_S = 30.0


class PrefixIndex:
    """One replica's cached hashes (from its events) plus its credited hashes.

    Credits are bounded by `max_credits` (oldest dropped first) and live `credit_ttl_s`
    seconds: long enough for the replica to compute the blocks and publish them, short enough
    that a credit for blocks it never stored (an aborted request) stops attracting traffic.

    Two sources, read together: the replica's KV events (a `CacheMirror`, exact up to the events
    in transit) and credits — the blocks of requests just routed to it, which it is about to
    compute and will announce only after its next step. Credits expire; events never do. Owns no
    sockets and no clock: the caller feeds events and passes the time.
    """

    def __init__(
        self,
        max_credits: int,
        credit_ttl_s: float = DEFAULT_CREDIT_TTL_S,
        shared: CacheMirror | None = None,
    ) -> None:
        self.mirror = CacheMirror()
        self.shared = shared if shared is not None else CacheMirror()  # every replica's
        self.max_credits = max_credits
        self.credit_ttl_s = credit_ttl_s
        self._credits: OrderedDict[ExternalBlockHash, float] = OrderedDict()

    def apply(self, batches: Iterable[KVEventBatch]) -> None:
        """The replica's events: those of the shared tier go to the mirror every replica's
        index reads (a block any replica wrote there, every replica can load)."""
        for batch in batches:
            shared = [e for e in batch.events if getattr(e, "medium", None) == MEDIUM_REMOTE]
            if shared:
                own = [e for e in batch.events if getattr(e, "medium", None) != MEDIUM_REMOTE]
                self.shared.apply([msgspec.structs.replace(batch, events=shared)])
                batch = msgspec.structs.replace(batch, events=own)
            self.mirror.apply([batch])

    def credit(self, block_hashes: Sequence[ExternalBlockHash], now: float) -> None:
        """Count `block_hashes` as held until `now + credit_ttl_s`, whatever the events say
        meanwhile (once the replica stores them, its events keep them held)."""
        deadline = now + self.credit_ttl_s
        credits = self._credits
        for block_hash in block_hashes:
            credits[block_hash] = deadline
            credits.move_to_end(block_hash)
        while len(credits) > self.max_credits:
            credits.popitem(last=False)

    def overlap(self, block_hashes: Sequence[ExternalBlockHash], now: float) -> int:
        """How many leading blocks of `block_hashes` this replica holds or is credited with."""
        self._expire(now)
        mirror, credits = self.mirror, self._credits
        num_held = 0
        for block_hash in block_hashes:
            if block_hash not in mirror and block_hash not in credits:
                break
            num_held += 1
        return num_held

    def shared_overlap(self, block_hashes: Sequence[ExternalBlockHash], start: int) -> int:
        """How many leading blocks after the first `start` (those the replica holds) it holds
        or the shared tier does: what it would load from the shared store."""
        num_more = 0
        for block_hash in block_hashes[start:]:
            if block_hash not in self.shared and block_hash not in self.mirror:
                break
            num_more += 1
        return num_more

    def clear(self) -> None:
        """Forget everything (the replica is gone)."""
        self.mirror.clear()
        self._credits.clear()

    def clear_events(self) -> None:
        """Forget what the events said, keep the credits: the replica's event stream lost
        batches for good, so its cache may hold anything now, but what was just routed to it
        is as much on its way there as before."""
        self.mirror.clear()

    @property
    def num_blocks(self) -> int:
        """Hashes known from events (every tier), credits excluded."""
        return len(self.mirror)

    @property
    def num_credits(self) -> int:
        return len(self._credits)

    def _expire(self, now: float) -> None:
        # Credits are kept in deadline order (each refresh moves one to the end).
        credits = self._credits
        while credits:
            block_hash, deadline = next(iter(credits.items()))
            if deadline > now:
                return
            del credits[block_hash]
