"""First touches kept out of steps: KV cache pages mapped in ahead of the blocks written, and
glibc told to keep freed memory."""

from __future__ import annotations

import ctypes
import gc
import mmap
import platform
import sys
import threading

import pytest
import torch

from blockserve.model.arch import LlamaArchConfig
from blockserve.runner import page_mapping
from blockserve.runner.kv_cache import allocate_kv_caches
from blockserve.runner.page_mapping import KVPagePopulator, blocks_per_step, keep_freed_memory
from tests.model.test_arch import BASE
from tests.runner.test_kv_cache import resident_pages

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="MADV_POPULATE_WRITE and mincore are Linux's"
)

# 3 layers, 4 KV heads of 16 dims, float32: one 16-token block of one plane (a layer's K or
# V) is 16 * 4 * 16 * 4 bytes = one 4 KiB page, so blocks and pages line up.
ARCH = LlamaArchConfig.from_hf({**BASE, "num_key_value_heads": 4, "num_hidden_layers": 3})
NUM_BLOCKS = 40
WAIT_S = 30.0


def planes(caches: list[torch.Tensor]) -> list[torch.Tensor]:
    return [cache[kv] for cache in caches for kv in range(2)]


def mapped_blocks(caches: list[torch.Tensor]) -> list[list[int]]:
    """Per plane, the blocks whose page is mapped in (block b is page b of its plane)."""
    return [
        [b for b in range(NUM_BLOCKS) if resident_pages(plane[b])[0] == 1]
        for plane in planes(caches)
    ]


def kv_caches() -> list[torch.Tensor]:
    caches = allocate_kv_caches(ARCH, NUM_BLOCKS, 16, torch.float32, torch.device("cpu"))
    assert planes(caches)[0][0].numel() * 4 == mmap.PAGESIZE == 4096
    return caches


def test_a_step_takes_at_most_its_tokens_blocks_and_one_a_sequence() -> None:
    """2,048 tokens / 16 + 64 sequences = 192 blocks; 100 / 16 rounds down, + 3."""
    assert blocks_per_step(2048, 64, 16) == 192
    assert blocks_per_step(100, 3, 16) == 6 + 3


@pytest.mark.slow
def test_the_blocks_ahead_are_mapped_in_every_plane_and_no_further() -> None:
    """With 5 blocks ahead, blocks 0-4 of every layer's K and V are mapped in, the rest not;
    a write into block 9 moves the target to blocks 0-14."""
    caches = kv_caches()
    populator = KVPagePopulator(caches, ahead=5)
    try:
        assert populator.wait_mapped(5, WAIT_S)
        assert populator.mapped_blocks == 5
        assert mapped_blocks(caches) == [[0, 1, 2, 3, 4]] * 6
        populator.note_written(9)
        assert populator.wait_mapped(15, WAIT_S)
        assert mapped_blocks(caches) == [list(range(15))] * 6
        assert not populator.wait_mapped(16, 0.2)  # nothing past the target
    finally:
        populator.close()


def test_mapping_in_changes_no_byte() -> None:
    """Values written before their page is mapped in ahead are still there after it; the
    rest of the cache still reads zero."""
    caches = kv_caches()
    caches[2][1, 3].fill_(2.5)  # layer 2's V, block 3
    populator = KVPagePopulator(caches, ahead=NUM_BLOCKS)
    try:
        assert populator.wait_mapped(NUM_BLOCKS, WAIT_S)
    finally:
        populator.close()
    assert caches[2][1, 3].eq(2.5).all()
    assert [cache.count_nonzero().item() for cache in caches] == [0, 0, 16 * 4 * 16]
    assert [resident_pages(cache) for cache in caches] == [(80, 80)] * 3


def test_the_target_never_passes_the_cache() -> None:
    """A write near the end asks for blocks past it: the last block is the last mapped."""
    caches = kv_caches()
    populator = KVPagePopulator(caches, ahead=100)
    try:
        populator.note_written(NUM_BLOCKS - 1)
        assert populator.wait_mapped(NUM_BLOCKS, WAIT_S)
        assert mapped_blocks(caches) == [list(range(NUM_BLOCKS))] * 6
    finally:
        populator.close()


def test_map_now_returns_with_the_blocks_mapped() -> None:
    """map_now(12) returns True with blocks 0-11 of every plane mapped in, and no more
    (nothing ahead was asked for)."""
    caches = kv_caches()
    populator = KVPagePopulator(caches, ahead=0)
    try:
        assert populator.map_now(12) is True
        assert populator.mapped_blocks == 12
        assert mapped_blocks(caches) == [list(range(12))] * 6
    finally:
        populator.close()


@pytest.mark.slow
def test_without_the_call_nothing_is_mapped_and_writes_still_work(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where madvise(MADV_POPULATE_WRITE) is missing, map_now says False at once, the thread
    ends, and the cache is left to its writes."""
    monkeypatch.setattr(page_mapping, "_load_madvise", lambda: None)
    caches = kv_caches()
    populator = KVPagePopulator(caches, ahead=8)
    assert populator.map_now(4) is False
    populator._thread.join(WAIT_S)
    assert not populator._thread.is_alive()
    populator.note_written(3)
    assert mapped_blocks(caches) == [[]] * 6
    caches[0][0, 2].fill_(1.0)
    assert mapped_blocks(caches)[0] == [2]


def threads_named(name: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == name]


def test_close_stops_the_thread() -> None:
    """close() returns after the thread has ended; a later target maps nothing more."""
    before = len(threads_named("blockserve-kv-pages"))
    caches = kv_caches()
    populator = KVPagePopulator(caches, ahead=2)
    assert populator.wait_mapped(2, WAIT_S)
    populator.close()
    assert len(threads_named("blockserve-kv-pages")) == before
    populator.note_written(20)
    assert not populator.wait_mapped(3, 0.2)
    assert mapped_blocks(caches)[0] == [0, 1]


def test_a_dropped_populator_ends_its_thread() -> None:
    """Collecting the populator (a runner going away) closes it: its thread ends."""
    before = len(threads_named("blockserve-kv-pages"))
    populator = KVPagePopulator(kv_caches(), ahead=1)
    assert populator.wait_mapped(1, WAIT_S)
    (thread,) = [t for t in threads_named("blockserve-kv-pages") if t is populator._thread]
    del populator
    gc.collect()
    thread.join(WAIT_S)
    assert not thread.is_alive()
    assert len(threads_named("blockserve-kv-pages")) == before


MALLINFO2_FIELDS = ("arena", "ordblks", "smblks", "hblks", "hblkhd")
MALLINFO2_FIELDS += ("usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")


class MallInfo2(ctypes.Structure):
    """glibc's struct mallinfo2 (malloc.h): ten size_t counters."""

    _fields_ = [(name, ctypes.c_size_t) for name in MALLINFO2_FIELDS]


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_glibc_keeps_freed_memory() -> None:
    """After keep_freed_memory(), five 20 MiB allocations come from the heap, not mappings of
    their own, and freeing them all (100 MiB at the heap's top, past the 64 MiB most that
    glibc's own thresholds would keep) returns nothing to the OS. Process-wide, and stays."""
    libc = ctypes.CDLL(None)
    libc.mallinfo2.restype = MallInfo2
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    assert keep_freed_memory() is True
    before = libc.mallinfo2()
    blocks = [libc.malloc(20 << 20) for _ in range(5)]
    for block in blocks:
        ctypes.memset(block, 1, 20 << 20)
    held = libc.mallinfo2()
    for block in reversed(blocks):
        libc.free(block)
    after = libc.mallinfo2()
    assert (held.hblks, held.hblkhd) == (before.hblks, before.hblkhd)  # no mapping of its own
    # Process-wide counts: another thread of the test process (an engine's, from an earlier
    # test) may free a few bytes meanwhile, so a MiB of slack (seen: 1,856 bytes short).
    assert held.uordblks - before.uordblks >= (100 << 20) - (1 << 20)
    assert after.arena == held.arena  # nothing returned to the OS
