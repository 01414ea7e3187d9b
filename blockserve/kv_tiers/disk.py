"""`DiskStore`: blocks as files in a directory, bounded in bytes, least recently used out first."""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from collections import OrderedDict
from pathlib import Path

import torch

from blockserve.kv_tiers.store import (
    RECORD_HEADER,
    BlockShape,
    Read,
    Write,
    capacity_in_blocks,
    check_block,
    pack_block,
    unpack_block,
)

logger = logging.getLogger(__name__)

_SUFFIX = ".kv"
_TEMP = ".tmp"


class DiskStore:
    """One file per block, `blocks/<first two hex digits>/<hash hex>.kv`: a 24-byte header (magic,
    format version, payload length, xxh3-64 checksum of the payload) and the block's bytes. A
    block is written to a temporary name in the same folder and renamed over its final name, so
    a reader (or a process that starts after a SIGKILL mid-write) sees the whole file or none;
    leftover temporary files are deleted when the store opens. A file whose size, header or
    checksum is wrong is deleted when found — on open for a wrong size, on read otherwise — and
    read as a miss.

    The LRU order lives in memory and is rebuilt on open from the files' modification times,
    which the store sets itself on every write and read, so the order survives a restart. Files
    are not fsynced: a crash of the process loses nothing written, a crash of the machine may
    lose recent blocks, never corrupt one that is served (the checksum sees to that).
    """

    def __init__(self, root: Path | str, shape: BlockShape, capacity_bytes: int) -> None:
        self.root = Path(root)
        self.shape = shape
        self.capacity_bytes = capacity_bytes
        self.damaged_on_open = 0  # files of the wrong size, deleted
        self._file_bytes = RECORD_HEADER.size + shape.nbytes
        self._capacity_blocks = capacity_in_blocks(shape, capacity_bytes)
        self._index: OrderedDict[bytes, None] = OrderedDict()
        self._lock = threading.Lock()
        self._temp_names = itertools.count()
        self._clock = 0  # the last modification time given to a file (ns)
        (self.root / "blocks").mkdir(parents=True, exist_ok=True)
        self._open()

    def _path(self, key: bytes) -> Path:
        name = key.hex()
        return self.root / "blocks" / name[:2] / f"{name}{_SUFFIX}"

    def _open(self) -> None:
        """Index the files already there (oldest first); drop leftovers and wrong sizes."""
        found: list[tuple[int, bytes]] = []
        for path in (self.root / "blocks").glob("*/*"):
            if _TEMP in path.name:
                path.unlink(missing_ok=True)  # a write that never finished
                continue
            if path.suffix != _SUFFIX:
                continue
            try:
                key = bytes.fromhex(path.stem)
                stat = path.stat()
            except (ValueError, OSError):
                continue
            if stat.st_size != self._file_bytes:
                self._drop(path, "has the wrong size")
                self.damaged_on_open += 1
                continue
            found.append((stat.st_mtime_ns, key))
        for mtime, key in sorted(found):
            self._index[key] = None
            self._clock = max(self._clock, mtime)
        while len(self._index) > self._capacity_blocks:
            self._evict_oldest()

    def __contains__(self, key: bytes) -> bool:
        with self._lock:
            return key in self._index

    def __len__(self) -> int:
        with self._lock:
            return len(self._index)

    @property
    def used_bytes(self) -> int:
        return len(self) * self.shape.nbytes

    def put(self, key: bytes, block: torch.Tensor) -> Write:
        check_block(self.shape, block)
        payload = block.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes()
        with self._lock:
            if key in self._index:
                self._index.move_to_end(key)
                return Write()
            if self._capacity_blocks == 0:
                return Write()
            evicted = []
            while len(self._index) >= self._capacity_blocks:
                evicted.append(self._evict_oldest())
            path = self._path(key)
            path.parent.mkdir(exist_ok=True)
            temp = path.with_name(f"{path.name}{_TEMP}{os.getpid()}-{next(self._temp_names)}")
            with open(temp, "wb") as file:
                file.write(pack_block(payload))
            os.replace(temp, path)
            self._touch(path)
            self._index[key] = None
            return Write(stored=True, evicted=tuple(evicted))

    def get(self, key: bytes) -> Read:
        with self._lock:
            if key not in self._index:
                return Read()
            path = self._path(key)
            payload = self._read(path)
            if payload is None:  # damaged, or gone from under us: dropped
                del self._index[key]
                return Read(damaged=True)
            self._index.move_to_end(key)
            self._touch(path)
        return Read(torch.frombuffer(payload, dtype=self.shape.dtype).view(self.shape.shape))

    def _read(self, path: Path) -> bytearray | None:
        """The payload of a sound file; a damaged or missing one is deleted and None."""
        try:
            with open(path, "rb") as file:
                data = bytearray(file.read())
        except OSError:
            return None
        payload, wrong = unpack_block(data, self.shape.nbytes)
        if payload is None:
            self._drop(path, wrong)
        return payload

    def _touch(self, path: Path) -> None:
        """Stamp `path` later than every file before it: the LRU order survives a restart
        (the file system's own clock ticks too coarsely to order writes a moment apart)."""
        self._clock = max(time.time_ns(), self._clock + 1)
        os.utime(path, ns=(self._clock, self._clock))

    def _drop(self, path: Path, why: str) -> None:
        logger.warning("KV disk tier: %s %s; deleted, its tokens will be computed", path, why)
        path.unlink(missing_ok=True)

    def _evict_oldest(self) -> bytes:
        key, _ = self._index.popitem(last=False)
        self._path(key).unlink(missing_ok=True)
        return key

    def remove(self, key: bytes) -> bool:
        with self._lock:
            if key not in self._index:
                return False
            del self._index[key]
            self._path(key).unlink(missing_ok=True)
            return True

    def keys(self) -> list[bytes]:
        with self._lock:
            return list(self._index)
