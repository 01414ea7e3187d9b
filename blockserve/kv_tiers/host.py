"""`HostStore`: blocks in host memory, bounded in bytes, least recently used out first."""

from __future__ import annotations

import threading
from collections import OrderedDict

import torch

from blockserve.kv_tiers.store import BlockShape, Read, Write, capacity_in_blocks, check_block


class HostStore:
    """With a CUDA device the blocks sit in pinned memory, so a copy to or from the device runs
    without a staging copy. On a CPU device the device tier already is host memory: a host tier
    only moves blocks from one part of RAM to another, and the same RAM would serve better as a
    bigger device tier (more blocks, no copy on a hit); it is allowed, for testing and for
    symmetry.
    """

    def __init__(self, shape: BlockShape, capacity_bytes: int, pin_memory: bool = False) -> None:
        self.shape = shape
        self.capacity_bytes = capacity_bytes
        self.damaged_on_open = 0  # memory starts empty
        self._capacity_blocks = capacity_in_blocks(shape, capacity_bytes)
        self._pin = pin_memory
        self._blocks: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self._lock = threading.Lock()

    def __contains__(self, key: bytes) -> bool:
        with self._lock:
            return key in self._blocks

    def __len__(self) -> int:
        with self._lock:
            return len(self._blocks)

    @property
    def used_bytes(self) -> int:
        return len(self) * self.shape.nbytes

    def put(self, key: bytes, block: torch.Tensor) -> Write:
        check_block(self.shape, block)
        with self._lock:
            if key in self._blocks:
                self._blocks.move_to_end(key)
                return Write()
            if self._capacity_blocks == 0:
                return Write()
            evicted = []
            while len(self._blocks) >= self._capacity_blocks:
                old, _ = self._blocks.popitem(last=False)
                evicted.append(old)
            copy = torch.empty(self.shape.shape, dtype=self.shape.dtype, pin_memory=self._pin)
            copy.copy_(block)
            self._blocks[key] = copy
            return Write(stored=True, evicted=tuple(evicted))

    def get(self, key: bytes) -> Read:
        with self._lock:
            block = self._blocks.get(key)
            if block is not None:
                self._blocks.move_to_end(key)
            return Read(block)

    def remove(self, key: bytes) -> bool:
        with self._lock:
            return self._blocks.pop(key, None) is not None

    def keys(self) -> list[bytes]:
        with self._lock:
            return list(self._blocks)
