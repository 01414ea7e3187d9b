"""The `lpm` waiting queue: longest cached prefix first, with aging, kept current incrementally.
Owns the order of waiting requests under `--scheduling-policy lpm` and each one's cached-prefix
length. Reads the prefix cache and listens to its store/remove events; never allocates, evicts or
decides admission (the scheduler does)."""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from blockserve.core.hashing import BlockHash
from blockserve.sched.request import Request


@dataclass(slots=True, eq=False)
class _Waiting:
    """One queued request: its matchable hashes and how many of them lead into the cache."""

    request: Request
    seq: int  # add order: the tie-break, so equal keys are served first come, first served
    hashes: Sequence[BlockHash]
    num_matched_blocks: int = 0
    version: int = 0  # bumped at each re-key; heap entries of older versions are stale
    key: float = field(default=0.0)


class LpmQueue:
    """Waiting requests ordered by *virtual arrival*, the earliest first:

        virtual_arrival = arrival_time - aging_s * matched_tokens / max_model_len

    A cached prefix moves a request earlier by up to `aging_s` seconds (all of a full context
    cached). Hence the aging bound: **no request is admitted ahead of one that arrived more than
    `aging_s` seconds before it**, so a request with no match waits at most `aging_s` behind
    better-matching later arrivals. With nothing cached the order is FCFS; in a burst (arrivals
    closer together than the shifts) it is pure longest-prefix-match, as in SGLang.

    Matches are kept current without rescanning: every waiting request's matchable hashes are
    indexed (hash -> request -> depth), so a stored hash advances exactly the requests whose
    match stopped at it, and a removed hash cuts back exactly those whose match ran through it.
    Preempted requests wait in a separate front queue, served first in FCFS order (as `fcfs`).
    """

    def __init__(
        self,
        is_cached: Callable[[BlockHash], bool],
        block_size: int,
        max_model_len: int,
        aging_s: float,
    ) -> None:
        self._is_cached = is_cached
        self._block_size = block_size
        self._shift_per_block = aging_s * block_size / max_model_len
        self._front: deque[Request] = deque()
        self._entries: dict[Request, _Waiting] = {}
        self._heap: list[tuple[float, int, int, _Waiting]] = []
        self._watchers: dict[BlockHash, dict[_Waiting, int]] = {}
        self._num_added = 0
        self._head: Request | None = None  # what peek() last answered, for pop()

    # -- RequestQueue ---------------------------------------------------------------------

    def add(self, request: Request) -> None:
        # The last token is always recomputed, and a request that skips the cache matches none.
        max_blocks = (request.num_tokens - 1) // self._block_size
        hashes = () if request.skip_reading_prefix_cache else request.block_hashes[:max_blocks]
        entry = _Waiting(request, self._num_added, hashes)
        self._num_added += 1
        self._entries[request] = entry
        for depth, block_hash in enumerate(hashes):
            self._watchers.setdefault(block_hash, {})[entry] = depth
        self._extend_match(entry)

    def prepend(self, request: Request) -> None:
        self._front.appendleft(request)

    def peek(self) -> Request:
        if self._front:
            self._head = self._front[0]
        else:
            self._head = self._top().request
        return self._head

    def pop(self) -> Request:
        """The request `peek()` answered, even if matches moved since (admitting it stores its
        own blocks, which can re-key the queue); otherwise the current head."""
        head, self._head = self._head, None
        if head is None or head not in self._entries:  # the answer was the front, or is gone
            if self._front:
                return self._front.popleft()
            head = self._top().request
        self._forget(self._entries.pop(head))
        return head

    def remove(self, request: Request) -> None:
        entry = self._entries.pop(request, None)
        if entry is None:
            self._front.remove(request)
        else:
            self._forget(entry)

    def __len__(self) -> int:
        return len(self._front) + len(self._entries)

    def __iter__(self) -> Iterator[Request]:
        yield from self._front
        for entry in sorted(self._entries.values(), key=lambda e: (e.key, e.seq)):
            yield entry.request

    def num_matched_blocks(self, request: Request) -> int:
        """How many of a waiting request's leading blocks are cached, as this queue knows it."""
        return self._entries[request].num_matched_blocks

    # -- CacheListener: the pool's events keep every match current ------------------------

    def on_hashes_stored(
        self,
        block_hashes: Sequence[BlockHash],
        parent_block_hash: BlockHash | None,
        token_ids: Sequence[int],
        cache_salt: str | None,
    ) -> None:
        for block_hash in block_hashes:
            for entry, depth in list(self._watchers.get(block_hash, {}).items()):
                if entry.num_matched_blocks == depth:
                    self._extend_match(entry)

    def on_hash_removed(self, block_hash: BlockHash) -> None:
        for entry, depth in self._watchers.get(block_hash, {}).items():
            if entry.num_matched_blocks > depth:
                self._rekey(entry, depth)

    def on_cache_cleared(self) -> None:
        for entry in self._entries.values():
            if entry.num_matched_blocks:
                self._rekey(entry, 0)

    # -- internals -------------------------------------------------------------------------

    def _extend_match(self, entry: _Waiting) -> None:
        """Walk the cache from the entry's current match; re-key it (also when unchanged on
        the first call, which is how an added entry enters the heap)."""
        num_matched = entry.num_matched_blocks
        hashes = entry.hashes
        while num_matched < len(hashes) and self._is_cached(hashes[num_matched]):
            num_matched += 1
        if num_matched != entry.num_matched_blocks or entry.version == 0:
            self._rekey(entry, num_matched)

    def _rekey(self, entry: _Waiting, num_matched: int) -> None:
        entry.num_matched_blocks = num_matched
        entry.version += 1
        entry.key = entry.request.arrival_time - num_matched * self._shift_per_block
        heapq.heappush(self._heap, (entry.key, entry.seq, entry.version, entry))
        if len(self._heap) > 4 * len(self._entries) + 64:
            self._compact()

    def _top(self) -> _Waiting:
        """The earliest live entry; drops stale heap entries on the way. IndexError if none."""
        heap = self._heap
        while heap:
            _, _, version, entry = heap[0]
            if version == entry.version and self._entries.get(entry.request) is entry:
                return entry
            heapq.heappop(heap)
        raise IndexError("peek from an empty queue")

    def _compact(self) -> None:
        self._heap = [(e.key, e.seq, e.version, e) for e in self._entries.values()]
        heapq.heapify(self._heap)

    def _forget(self, entry: _Waiting) -> None:
        entry.version = -1
        for block_hash in entry.hashes:
            watchers = self._watchers.get(block_hash, {})
            watchers.pop(entry, None)  # None: a hash repeated within one chain (a collision)
            if not watchers:
                self._watchers.pop(block_hash, None)
