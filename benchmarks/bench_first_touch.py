"""What mapping in a page of anonymous memory costs on this host: the first write to fresh
memory, the same again at once (memory just freed), again after a pause, and
madvise(MADV_POPULATE_WRITE) from one and two threads (what runner/page_mapping.py uses).

On a VM whose host backs guest memory lazily, and takes freed memory back (free page
reporting), "fresh" and "after a pause" cost far more than "at once".

    .venv/bin/python benchmarks/bench_first_touch.py [--mib 1024] [--pause 20] [--out FILE]
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import threading
import time
from pathlib import Path

import numpy as np
from report import emit

MADV_POPULATE_WRITE = 23
PAGE = mmap.PAGESIZE


def touch_us_per_page(mib: int) -> float:
    """Write one byte a page into a fresh mapping of `mib` MiB: microseconds a page."""
    mapping = mmap.mmap(-1, mib << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    pages = np.frombuffer(mapping, dtype=np.uint8)
    start = time.perf_counter()
    pages[::PAGE] = 1
    seconds = time.perf_counter() - start
    del pages
    mapping.close()
    return seconds / ((mib << 20) // PAGE) * 1e6


def populate_us_per_page(mib: int, threads: int) -> float:
    """madvise(MADV_POPULATE_WRITE) over a fresh mapping, 64 KiB a call, split over
    `threads`: wall microseconds a page."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    size = mib << 20
    mapping = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    anchor = ctypes.c_char.from_buffer(mapping)
    base = ctypes.addressof(anchor)
    share = size // threads

    def work(first: int) -> None:
        for offset in range(first, first + share, 64 << 10):
            if libc.madvise(base + offset, 64 << 10, MADV_POPULATE_WRITE) != 0:
                raise OSError(ctypes.get_errno(), "madvise(MADV_POPULATE_WRITE)")

    workers = [threading.Thread(target=work, args=(i * share,)) for i in range(threads)]
    start = time.perf_counter()
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    seconds = time.perf_counter() - start
    del anchor
    mapping.close()
    return seconds / (size // PAGE) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=1024)
    parser.add_argument("--pause", type=float, default=20.0, help="seconds before the last")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    rows: dict[str, float] = {}
    rows["touch_fresh"] = touch_us_per_page(args.mib)
    rows["touch_at_once"] = touch_us_per_page(args.mib)
    time.sleep(args.pause)
    rows["touch_after_pause"] = touch_us_per_page(args.mib)
    time.sleep(args.pause)
    rows["populate_1_thread"] = populate_us_per_page(args.mib, 1)
    time.sleep(args.pause)
    rows["populate_2_threads"] = populate_us_per_page(args.mib, 2)
    for name, value in rows.items():
        print(f"{name:20s} {value:7.2f} us a 4 KiB page")
    emit(
        {
            "benchmark": "first_touch",
            "mib": args.mib,
            "pause_s": args.pause,
            "us_per_page": {name: round(value, 2) for name, value in rows.items()},
        },
        args.out,
    )


if __name__ == "__main__":
    main()
