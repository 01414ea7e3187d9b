"""Adapters in host memory: the least recently used leave past `capacity`; one asked for that
is missing is read back without holding a step up: a thread brings its file into the page
cache, then the engine thread converts it a module at a time between steps, within a small
share of the step time (on a host whose cores the steps use, a thread would slow them)."""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

from blockserve.lora.adapter import WEIGHTS, LoRAAdapter

logger = logging.getLogger(__name__)

Parts = Callable[[str, str], Iterator[LoRAAdapter | None]]  # adapter.read_in_parts, bound
SHARE = 0.05  # of the time between two steps that converting a read may take
MIN_BUDGET_S, MAX_BUDGET_S = 0.0005, 0.05


@dataclass
class _Read:
    path: str
    since: float  # when it was asked for
    cached: Future[None]  # the file is in the page cache
    parts: Iterator[LoRAAdapter | None] | None = None


class HostAdapters:
    def __init__(self, capacity: int, parts: Parts) -> None:
        self.capacity = capacity
        self._parts = parts
        self._lru: OrderedDict[str, LoRAAdapter] = OrderedDict()
        self._reads: dict[str, _Read] = {}
        self._pool: ThreadPoolExecutor | None = None  # started by the first read
        self._last_advance = time.perf_counter()
        self.failed: dict[str, str] = {}  # adapters whose read failed: the reason
        self.loads = 0  # reads after registration (the adapter had left host memory)
        self.load_seconds = 0.0  # from being asked for to being in memory, summed

    def get(self, name: str) -> LoRAAdapter | None:
        adapter = self._lru.get(name)
        if adapter is not None:
            self._lru.move_to_end(name)
        return adapter

    def keep(self, adapter: LoRAAdapter) -> None:
        self._lru[adapter.name] = adapter
        self._lru.move_to_end(adapter.name)
        while len(self._lru) > self.capacity:
            self._lru.popitem(last=False)

    def drop(self, name: str) -> None:
        """Forget `name`, and any read of it under way."""
        self._lru.pop(name, None)
        self._reads.pop(name, None)
        self.failed.pop(name, None)

    def request(self, name: str, path: str) -> bool:
        """Whether `name` is in host memory; if not, its read from `path` is under way."""
        if name in self._lru:
            return True
        if name not in self._reads and name not in self.failed:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lora-read")
            cached = self._pool.submit(_into_page_cache, Path(path) / WEIGHTS)
            self._reads[name] = _Read(path=path, since=time.perf_counter(), cached=cached)
        return False

    def advance(self, budget_s: float | None = None) -> None:
        """Convert reads whose file is cached, for `budget_s` (default: `SHARE` of the time
        since the last call, one step's); those done join host memory."""
        now = time.perf_counter()
        if budget_s is None:
            budget_s = min(MAX_BUDGET_S, max(MIN_BUDGET_S, SHARE * (now - self._last_advance)))
        self._last_advance, deadline = now, now + budget_s
        for name, read in list(self._reads.items()):
            if time.perf_counter() >= deadline:
                break
            if read.cached.done():
                self._convert(name, read, deadline)

    def wait(self, timeout: float) -> None:
        """Nothing else to run: until a file is cached (at most `timeout`), then convert."""
        pending = [r.cached for r in self._reads.values() if not r.cached.done()]
        if pending:
            wait(pending, timeout=timeout, return_when=FIRST_COMPLETED)
        self.advance(timeout)

    def read_now(self, name: str, path: str) -> LoRAAdapter:
        """Read `name` on this thread (a step needs it and it left host memory)."""
        start = time.perf_counter()
        adapter = next(a for a in self._parts(name, path) if a is not None)
        self._done(adapter, start)
        logger.warning("LoRA adapter %r read inside a step", name)
        return adapter

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    def _convert(self, name: str, read: _Read, deadline: float) -> None:
        try:
            read.cached.result()
            if read.parts is None:
                read.parts = self._parts(name, read.path)
            while time.perf_counter() < deadline:
                adapter = next(read.parts)
                if adapter is not None:
                    del self._reads[name]
                    self._done(adapter, read.since)
                    return
        except Exception as exc:  # files gone or changed since it was registered
            logger.error("LoRA adapter %r could not be read again: %s", name, exc)
            del self._reads[name]
            self.failed[name] = str(exc)

    def _done(self, adapter: LoRAAdapter, since: float) -> None:
        seconds = time.perf_counter() - since
        logger.info("LoRA adapter %r back in host memory after %.3f s", adapter.name, seconds)
        self.loads += 1
        self.load_seconds += seconds
        self.keep(adapter)


def _into_page_cache(path: Path) -> None:
    """Read the file through once (the reads release the GIL), so that converting it later
    waits for no disk."""
    with path.open("rb", buffering=0) as file:
        while file.read(1 << 20):
            pass
