"""Keeps first touches of memory out of the model's steps on a CPU: `KVPagePopulator` maps
the KV cache's next never-used blocks in ahead of the steps, and `keep_freed_memory` has glibc
keep freed temporaries mapped. Where the calls are missing, the writes map their own pages
(why: docs/cpu-kernels.md)."""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import platform
import sys
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

logger = logging.getLogger(__name__)

MADV_POPULATE_WRITE = 23  # linux/mman.h; Python's mmap module names it from 3.13 only
CALL_BYTES = 64 << 10  # a madvise call: 16 pages, so that one call stays short

Madvise = Callable[[int, int], bool]  # (address, length) → mapped

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # malloc.h
KEEP_FREED_BYTES = 1 << 30  # free memory the heap's top may hold before it is returned
OWN_MAPPING_BYTES = 32 << 20  # allocations served from the heap up to this (glibc's maximum)


def keep_freed_memory() -> bool:
    """Have glibc keep freed memory mapped (process-wide): allocations up to 32 MiB come from
    the heap, and its top is returned to the OS only beyond 1 GiB free. True if set."""
    if not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(None)
    return bool(
        libc.mallopt(M_MMAP_THRESHOLD, OWN_MAPPING_BYTES)
        and libc.mallopt(M_TRIM_THRESHOLD, KEEP_FREED_BYTES)
    )


def _load_madvise() -> Madvise | None:
    """libc's madvise with MADV_POPULATE_WRITE, or None off Linux."""
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(None, use_errno=True)  # ctypes releases the GIL around each call
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.madvise.restype = ctypes.c_int

    def populate(address: int, length: int) -> bool:
        return libc.madvise(address, length, MADV_POPULATE_WRITE) == 0

    return populate


def blocks_per_step(max_num_batched_tokens: int, max_num_seqs: int, block_size: int) -> int:
    """The most never-used blocks one step can take: its tokens fill at most
    tokens / block_size blocks, and each sequence may start one more."""
    return max_num_batched_tokens // block_size + max_num_seqs


class KVPagePopulator:
    """Keeps blocks [0, highest written + 1 + `ahead`) of every layer's K and V mapped in.

    `caches` are the layers' [2, num_blocks, ...] CPU tensors (contiguous); block b of a plane
    (one layer's K or V) is bytes [b * block_bytes, (b + 1) * block_bytes) from its start.
    The thread starts at once on blocks [0, ahead); `note_written(block_id)` moves the target;
    `map_now(n)` has the calling thread map alongside until blocks [0, n) are in. Blocks are
    mapped in ascending order and never unmapped. The thread stops on `close()`, or when this
    object is collected (or at exit): both wait for the calls in progress, and this object
    holds the caches, so their mapping outlives every call on it. The thread itself holds no
    tensor: dropping the last reference to one there could take the GIL while the interpreter
    exits, which aborts the process.
    """

    def __init__(self, caches: Sequence[torch.Tensor], ahead: int) -> None:
        self._caches = list(caches)  # the mapping lives while this object does
        plane = caches[0][0]
        block_bytes = plane[0].numel() * plane.element_size()
        self._state = _MappingState(
            planes=[cache[kv].data_ptr() for cache in caches for kv in range(2)],
            block_bytes=block_bytes,
            num_blocks=caches[0].shape[1],
            blocks_per_call=max(1, CALL_BYTES // block_bytes),
            populate=_load_madvise(),
        )
        self._state.raise_target(ahead)
        self.ahead = ahead
        self._thread = threading.Thread(
            target=self._state.run, name="blockserve-kv-pages", daemon=True
        )
        self._thread.start()
        weakref.finalize(self, self._state.close)

    @property
    def mapped_blocks(self) -> int:
        """Blocks [0, mapped_blocks) are mapped in."""
        with self._state.cond:
            return self._state.mapped

    def note_written(self, block_id: int) -> None:
        """A step wrote into `block_id`: keep the `ahead` blocks after it mapped too."""
        self._state.raise_target(block_id + 1 + self.ahead)

    def map_now(self, num_blocks: int) -> bool:
        """Map blocks [0, num_blocks) in, this thread taking spans beside the background one;
        returns once they are in (True) or mapping has stopped (False)."""
        state = self._state
        state.raise_target(num_blocks)
        while state.map_next_span(limit=num_blocks, wait=False):
            pass
        return self.wait_mapped(num_blocks, timeout=None)

    def wait_mapped(self, num_blocks: int, timeout: float | None) -> bool:
        """Wait until blocks [0, num_blocks) are mapped in; False at the timeout or if
        mapping stopped short of them."""
        state = self._state
        num_blocks = min(num_blocks, state.num_blocks)
        with state.cond:
            state.cond.wait_for(
                lambda: state.mapped >= num_blocks or (state.closed and not state.in_flight),
                timeout,
            )
            return state.mapped >= num_blocks

    def close(self) -> None:
        """Stop mapping after the calls in progress, and wait for the thread to end."""
        self._state.close()
        self._thread.join()


@dataclass(slots=True)
class _MappingState:
    """What the mapping threads share: addresses and counters, no tensor, all under `cond`.
    Spans are claimed in ascending order; `mapped` is where the lowest unfinished one starts.
    `close()` returning means no call is running and none will start."""

    planes: list[int]  # each plane's first byte
    block_bytes: int
    num_blocks: int
    blocks_per_call: int
    populate: Madvise | None  # None: nothing can be mapped in ahead here
    target: int = 0  # blocks [0, target) are to be mapped in
    claimed: int = 0  # blocks [0, claimed) are mapped in or being mapped
    in_flight: set[int] = field(default_factory=set)  # the first blocks of spans being mapped
    closed: bool = False
    cond: threading.Condition = field(default_factory=threading.Condition)

    @property
    def mapped(self) -> int:
        return min(self.in_flight, default=self.claimed)

    def raise_target(self, target: int) -> None:
        target = min(self.num_blocks, target)
        if target > self.target:  # the common case, once a step, takes no lock
            with self.cond:
                self.target = max(self.target, target)
                self.cond.notify_all()

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify_all()
            self.cond.wait_for(lambda: not self.in_flight)

    def run(self) -> None:
        """The background thread: map spans up to the target until closed or done."""
        if hasattr(os, "SCHED_IDLE"):
            # This thread only. Refused, it runs at the normal priority: its calls are short.
            with contextlib.suppress(OSError):
                os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        while self.map_next_span(limit=self.num_blocks, wait=True):
            pass

    def map_next_span(self, limit: int, wait: bool) -> bool:
        """Claim the next span below min(target, limit) (waiting for one if `wait`) and map
        it in; False when there is none to claim, or mapping has stopped."""
        with self.cond:
            if wait:
                self.cond.wait_for(
                    lambda: (
                        self.closed or self.claimed < self.target or self.claimed == self.num_blocks
                    )
                )
            end = min(self.target, limit, self.claimed + self.blocks_per_call)
            if self.closed or self.populate is None or self.claimed >= end:
                if self.populate is None or self.claimed == self.num_blocks:
                    self.closed = True  # nothing more will ever be mapped
                    self.cond.notify_all()
                return False
            start, self.claimed = self.claimed, end
            self.in_flight.add(start)
            populate = self.populate
        page = os.sysconf("SC_PAGE_SIZE")
        ok = True
        for plane in self.planes:
            first = (plane + start * self.block_bytes) // page * page
            if not populate(first, plane + end * self.block_bytes - first):
                logger.info(
                    "KV cache pages are left to the writes that need them: "
                    "madvise(MADV_POPULATE_WRITE) failed with errno %d",
                    ctypes.get_errno(),
                )
                ok = False
                break
        with self.cond:
            self.in_flight.discard(start)
            if not ok:
                self.closed = True
            self.cond.notify_all()
        return ok
