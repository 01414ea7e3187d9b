"""`KVTiers`: the stores below the device, fed and read in the background."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from blockserve.core.cache_types import RequestId
from blockserve.core.events import KVEvent
from blockserve.core.hashing import BlockHash
from blockserve.kv_tiers.store import FilledBlock, LocalStore, SharedStore, Tier
from blockserve.kv_tiers.tier_events import TierEvents

logger = logging.getLogger(__name__)

DEFAULT_MAX_PENDING_BYTES = 256 << 20


@dataclass(slots=True)
class _Load:
    request_id: RequestId
    block_hashes: tuple[BlockHash, ...]
    block_ids: tuple[int, ...]
    cancelled: bool = False
    done: threading.Event = field(default_factory=threading.Event)


class KVTiers:
    """The tiers below one device cache, top (host) first; see the module docstring.

    Write path: after a step, the engine hands over the blocks the step filled (`store`). Blocks
    that every tier already holds, or that are queued already, are skipped; the rest are copied
    out of the device cache in one gather (a memory copy, the only part a step waits for) and
    put into each tier that lacks them by a writer thread. Copies queued beyond
    `max_pending_bytes` are dropped and counted, so a slow disk costs hits, never step time.

    Read path: the scheduler asks which tier holds the blocks after a request's device hit
    (`lookup`: in-memory indexes only), allocates device blocks for them and calls `start_load`.
    A loader thread, separate from the writer so a write backlog never delays a request, reads
    each block (host first) into its device block and stops at the first one that is missing or
    damaged; `finished_loads` tells the scheduler how many leading blocks arrived. A block read
    from the disk is kept in the host tier too (promotion).

    Every block a tier stores or drops is recorded as a KV event with that tier's medium ("CPU",
    "DISK"), so a router knows what each replica can restore.
    """

    def __init__(
        self,
        tiers: Sequence[Tier[LocalStore]],
        kv_caches: Sequence[torch.Tensor],
        block_size: int,
        events_hash_format: str | None = None,
        max_pending_bytes: int = DEFAULT_MAX_PENDING_BYTES,
        on_write: Callable[[], None] = lambda: None,  # per block loaded (loader's thread)
        shared: Tier[SharedStore] | None = None,
    ) -> None:
        self.local = tuple(tiers)
        # The shared tier (last) is asked in batches, never block by block on a step; its
        # events (medium "REMOTE") say what this replica wrote there.
        self.shared = shared
        self.tiers: tuple[Tier[Any], ...] = (*self.local, *([shared] if shared else []))
        # Blocks read from a lower tier are kept in host memory too (promotion), if it is one.
        self._host = next((t for t in self.local if t.medium == "CPU"), None)
        self.kv_caches = list(kv_caches)
        self.on_write = on_write
        self.block_size = block_size
        self.max_pending_bytes = max_pending_bytes
        self.num_dropped_writes = 0  # blocks not written because the queue was full
        self._events = TierEvents(self.tiers, events_hash_format, block_size)
        self._lock = threading.Lock()  # pending writes, finished loads
        # Held around each store change and the events it records: the two threads' events
        # then come in the order the stores changed.
        self._tier_locks = {tier.name: threading.Lock() for tier in self.tiers}
        self._pending: set[BlockHash] = set()
        self._pending_bytes = 0
        self._finished: dict[RequestId, int] = {}
        self._finished_event = threading.Event()
        self._loads_by_id: dict[RequestId, _Load] = {}
        self._loads_done: dict[str, list[float]] = {tier.name: [0, 0.0] for tier in self.tiers}
        self._writes: queue.Queue[tuple[list[FilledBlock], torch.Tensor] | None] = queue.Queue()
        self._loads: queue.Queue[_Load | None] = queue.Queue()
        self._writer = threading.Thread(target=self._write_loop, name="kv-tier-writer")
        self._loader = threading.Thread(target=self._load_loop, name="kv-tier-loader")
        self._writer.start()
        self._loader.start()

    @property
    def block_nbytes(self) -> int:
        return self.tiers[0].store.shape.nbytes

    # -- read path (the scheduler's TierLoader) -------------------------------------------

    def lookup(self, block_hashes: Sequence[BlockHash]) -> list[str]:
        """The tier of each leading block held below the device: host, disk, then the remote
        store (asked once for the rest, within its lookup timeout)."""
        found = []
        for block_hash in block_hashes:
            tier = next((t for t in self.local if block_hash in t.store), None)
            if tier is None:
                break
            found.append(tier.name)
        if self.shared is None or len(found) == len(block_hashes):
            return found
        rest = block_hashes[len(found) :]
        for block_hash, held in zip(rest, self.shared.store.contains_many(rest), strict=True):
            tier = next((t for t in self.local if block_hash in t.store), None)
            if tier is None and not held:
                break
            found.append(tier.name if tier is not None else self.shared.name)
        return found

    def start_load(
        self, request_id: RequestId, block_hashes: Sequence[BlockHash], block_ids: Sequence[int]
    ) -> None:
        load = _Load(request_id, tuple(block_hashes), tuple(block_ids))
        with self._lock:
            self._loads_by_id[request_id] = load
        self._loads.put(load)

    def finished_loads(self) -> dict[RequestId, int]:
        with self._lock:
            finished, self._finished = self._finished, {}
            self._finished_event.clear()
        return finished

    def cancel_load(self, request_id: RequestId) -> None:
        with self._lock:
            load = self._loads_by_id.get(request_id)
        if load is not None:
            load.cancelled = True
            load.done.wait()
        with self._lock:
            self._finished.pop(request_id, None)

    def wait_for_loads(self, timeout: float) -> None:
        """Block until a load finishes (or `timeout` seconds): for a step with nothing else
        to run, instead of spinning."""
        self._finished_event.wait(timeout)

    def _load_loop(self) -> None:
        while (load := self._loads.get()) is not None:
            num_loaded = 0
            try:
                num_loaded = self._load(load)
            except Exception:  # a broken read costs the blocks, never the loader
                logger.exception("KV tiers: a load failed; its tokens will be computed")
            with self._lock:
                del self._loads_by_id[load.request_id]
                if not load.cancelled:
                    self._finished[load.request_id] = num_loaded
                    self._finished_event.set()
            load.done.set()

    def _load(self, load: _Load) -> int:
        """Read the blocks into the device, in order; the count read before the first miss."""
        seconds: dict[str, float] = {}
        num_loaded = 0
        for block_hash, block_id in zip(load.block_hashes, load.block_ids, strict=True):
            if load.cancelled:
                break
            block, tier = self._read(block_hash, seconds)
            if block is None or tier is None:
                break
            for layer, kv in enumerate(self.kv_caches):
                kv[:, block_id].copy_(block[layer], non_blocking=False)
            self.on_write()
            if self._host is not None and tier is not self._host:
                self._put(self._host, block_hash, block, None)  # the next hit is in memory
            num_loaded += 1
        with self._lock:
            for name, spent in seconds.items():
                self._loads_done[name][0] += 1
                self._loads_done[name][1] += spent
        return num_loaded

    def _read(
        self, block_hash: BlockHash, seconds: dict[str, float]
    ) -> tuple[torch.Tensor | None, Tier[Any] | None]:
        """The block from the first tier that has it sound, and that tier; each tier's time
        reading a block it held added to `seconds` (the shared tier was looked up: it holds
        the blocks asked of it)."""
        for tier in self.tiers:
            held = tier is self.shared or block_hash in tier.store
            started = time.perf_counter()
            with self._tier_locks[tier.name]:  # a drop and its event, before any put
                read = tier.get(block_hash)
                if read.damaged:  # found damaged, dropped
                    self._events.removed(tier, [block_hash])
            if held:
                seconds[tier.name] = seconds.get(tier.name, 0.0) + time.perf_counter() - started
            if read.block is not None:
                return read.block, tier
        return None, None

    # -- write path -----------------------------------------------------------------------

    def store(self, blocks: Sequence[FilledBlock]) -> None:
        """Queue the blocks some tier lacks for writing; copies their KV out now."""
        with self._lock:
            wanted = [
                b
                for b in blocks
                if b.key not in self._pending and any(not self._holds(t, b.key) for t in self.tiers)
            ]
            room = (self.max_pending_bytes - self._pending_bytes) // self.block_nbytes
            if len(wanted) > room:
                self.num_dropped_writes += len(wanted) - max(room, 0)
                wanted = wanted[: max(room, 0)]
            if not wanted:
                return
            self._pending.update(b.key for b in wanted)
            self._pending_bytes += len(wanted) * self.block_nbytes
        ids = torch.tensor([b.block_id for b in wanted], device=self.kv_caches[0].device)
        # [blocks, layers, 2, block_size, heads, head_dim], on the CPU, one copy per layer.
        data = torch.stack([kv.index_select(1, ids) for kv in self.kv_caches], dim=1)
        data = data.transpose(0, 2).to("cpu").contiguous()
        self._writes.put((wanted, data))

    def _write_loop(self) -> None:
        while (job := self._writes.get()) is not None:
            blocks, data = job
            for index, block in enumerate(blocks):
                try:
                    for tier in self.tiers:
                        if not self._holds(tier, block.key):
                            self._put(tier, block.key, data[index], block)
                except Exception:  # a full disk costs this block, never the writer
                    logger.exception("KV tiers: writing a block failed")
                with self._lock:
                    self._pending.discard(block.key)
                    self._pending_bytes -= self.block_nbytes

    def _put(
        self, tier: Tier[Any], key: BlockHash, data: torch.Tensor, block: FilledBlock | None
    ) -> None:
        """Put one block into one tier under `key` and record what it stored (under its block
        hash, when known) and evicted."""
        with self._tier_locks[tier.name]:  # events in the order the store changed
            written = tier.put(key, data)
            self._events.removed(tier, written.evicted)
            if written.stored:  # written now, not only refreshed
                self._events.stored(tier, key if block is None else block.block_hash, block)

    def _holds(self, tier: Tier[Any], block_hash: BlockHash) -> bool:
        """Whether `tier` holds the block; the shared one as far as this process knows, or
        while it is down (nothing is copied out for a store that would drop it)."""
        if tier is self.shared:
            return self.shared.store.is_down or self.shared.store.known(block_hash)
        return block_hash in tier.store

    # -- state ----------------------------------------------------------------------------

    def take_events(self) -> list[KVEvent]:
        return self._events.take()

    def load_totals(self, tier: Tier[Any]) -> tuple[int, float]:
        """Loads that read from `tier`, and their total seconds reading from it."""
        with self._lock:
            count, seconds = self._loads_done[tier.name]
        return int(count), seconds

    def flush(self, timeout: float) -> bool:
        """Wait until every queued write and every load in flight is done (at most `timeout`
        s); whether they were."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if not self._pending and not self._loads_by_id:
                    return True
            time.sleep(0.005)
        return False

    def close(self, flush_timeout: float = 30.0) -> None:
        """Finish the queued writes (up to `flush_timeout` s), then stop both threads."""
        if not self._writer.is_alive():
            return
        if not self.flush(flush_timeout):
            logger.warning("KV tiers: closed with blocks still queued; they are not written")
        self._loads.put(None)
        self._writes.put(None)
        self._loader.join()
        self._writer.join()
        if self.shared is not None:
            self.shared.store.close()
