"""The tier stores' interfaces (local and shared), the tier that counts what they do, and the
record of one stored block: its K and V for every layer, keyed by its block hash."""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

import torch
import xxhash

from blockserve.core.hashing import BlockHash


@dataclass(frozen=True, slots=True)
class BlockShape:
    """What one stored block is: its tensor shape and dtype, the same for every block."""

    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def shape(self) -> tuple[int, int, int, int, int]:
        return (self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()


@dataclass(slots=True)
class StoreStats:
    """A tier's counters since its store was opened, kept by the tier from what each call
    returned (the stores count nothing themselves)."""

    hits: int = 0
    misses: int = 0
    stores: int = 0  # blocks written (a put of a key already held is not one)
    evictions: int = 0
    corrupt: int = 0  # blocks found damaged on read or open, and dropped


@dataclass(frozen=True, slots=True)
class Read:
    """What a `get` found: the block (a hit), or none, because the key was absent or because
    its record was damaged (then dropped from the store)."""

    block: torch.Tensor | None = None
    damaged: bool = False


@dataclass(frozen=True, slots=True)
class Write:
    """What a `put` did: whether it wrote the block (False: held already, or no room), and
    the keys it evicted to make room, oldest first."""

    stored: bool = False
    evicted: tuple[bytes, ...] = ()


class LocalStore(Protocol):
    """A store of this process's own (host memory, a disk directory): a bounded, LRU-ordered
    map from block hash to one block's KV, that can be scanned.

    A store below the device tier holds whole blocks — a [layers, 2, block_size, kv_heads,
    head_dim] tensor each — under the same hash bytes the device pool's hash map uses, so a key
    means the same in memory, on disk, after a restart and in another process. `put` of a new
    key evicts least recently used blocks until the new one fits, `put` of a key already held
    only refreshes it (the block is not written again), `get` refreshes the key it returns. A
    store never raises for a missing or damaged block: the caller computes those tokens.
    """

    shape: BlockShape
    capacity_bytes: int
    damaged_on_open: int  # blocks found damaged, and dropped, when the store opened

    def __contains__(self, key: bytes) -> bool: ...

    def __len__(self) -> int: ...

    @property
    def used_bytes(self) -> int: ...

    def put(self, key: bytes, block: torch.Tensor) -> Write: ...

    def get(self, key: bytes) -> Read:
        """The block under `key` (a CPU tensor of `shape`), if held and sound."""
        ...

    def remove(self, key: bytes) -> bool:
        """Drop `key`; whether it was held."""
        ...

    def keys(self) -> list[bytes]:
        """Held keys, least recently used first."""
        ...


class SharedStore(Protocol):
    """A store every replica shares (remote.py: a Redis-protocol server): no bound of its own
    (the server's settings are), asked in batches from the engine thread, and sometimes down.
    A fault changes speed, never an answer: a store that is down answers misses and writes
    nothing until it answers again."""

    shape: BlockShape
    url: str  # where it is, as a log may show it (no password)
    failures: int  # calls that found the store down, slow or refusing

    @property
    def is_down(self) -> bool: ...

    @property
    def used_bytes(self) -> int:
        """What this process wrote there."""
        ...

    def contains_many(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether the store holds each key: one round trip, bounded in time."""
        ...

    def known(self, key: bytes) -> bool:
        """Whether this process wrote or read `key` lately (no round trip)."""
        ...

    def check(self) -> str | None:
        """None when the store answers now, else why not (what the start-up log says)."""
        ...

    def put(self, key: bytes, block: torch.Tensor) -> Write: ...

    def get(self, key: bytes) -> Read: ...

    def close(self) -> None: ...


S = TypeVar("S", LocalStore, SharedStore)


@dataclass(frozen=True, slots=True)
class Tier(Generic[S]):
    """A store below the device and its counters: `put` and `get` go through here, which
    counts what each call returned (`stats` starts from what the store found at open).
    `medium` names the tier in KV events."""

    name: str  # "host", "disk" or "remote": the flag's and the response's name
    medium: str  # "CPU", "DISK" or "REMOTE": the KV events' name
    store: S
    stats: StoreStats = field(default_factory=StoreStats)

    def put(self, key: bytes, block: torch.Tensor) -> Write:
        written = self.store.put(key, block)
        self.stats.stores += written.stored
        self.stats.evictions += len(written.evicted)
        return written

    def get(self, key: bytes) -> Read:
        read = self.store.get(key)
        if read.block is not None:
            self.stats.hits += 1
        else:
            self.stats.misses += 1
            self.stats.corrupt += read.damaged
        return read


@dataclass(frozen=True, slots=True)
class FilledBlock:
    """A block a step filled: where it is, its key, and what its BlockStored event says."""

    block_id: int
    block_hash: BlockHash
    parent_hash: BlockHash | None
    token_ids: tuple[int, ...]
    lora_name: str | None = None
    extra_keys: tuple[Any, ...] | None = None  # untagged, as its BlockStored event carries them
    tier_key: BlockHash | None = None  # its key in the tiers, if not its hash (an adapter's)

    @property
    def key(self) -> BlockHash:
        """What the tiers store it under (core.hashing.tier_key)."""
        return self.block_hash if self.tier_key is None else self.tier_key


def check_block(shape: BlockShape, block: torch.Tensor) -> None:
    """A block must have the store's shape and dtype: a wrong one is a caller's bug."""
    if tuple(block.shape) != shape.shape or block.dtype != shape.dtype:
        raise ValueError(
            f"a block of shape {tuple(block.shape)} and dtype {block.dtype}; this store holds "
            f"{shape.shape} {shape.dtype}"
        )


def capacity_in_blocks(shape: BlockShape, capacity_bytes: int) -> int:
    return capacity_bytes // shape.nbytes


# A stored block, on disk or in a remote store: a header (magic, format version, payload
# bytes, xxh3-64 checksum of the payload) and the block's bytes.
RECORD_MAGIC = b"BSKV"
RECORD_VERSION = 1
RECORD_HEADER = struct.Struct("<4sB3xQQ")


def pack_block(payload: bytes) -> bytes:
    """`payload` (one block's bytes) with its header."""
    header = RECORD_HEADER.pack(
        RECORD_MAGIC, RECORD_VERSION, len(payload), xxhash.xxh3_64_intdigest(payload)
    )
    return header + payload


def unpack_block(record: bytes | bytearray, nbytes: int) -> tuple[bytearray | None, str]:
    """The payload of a sound record of an `nbytes` block, or None and what is wrong."""
    if len(record) != RECORD_HEADER.size + nbytes:
        return None, "has the wrong size"
    magic, version, length, checksum = RECORD_HEADER.unpack_from(record)
    payload = bytearray(memoryview(record)[RECORD_HEADER.size :])
    if (magic, version, length) != (RECORD_MAGIC, RECORD_VERSION, nbytes):
        return None, "has a bad header"
    if xxhash.xxh3_64_intdigest(payload) != checksum:
        return None, "fails its checksum"
    return payload, ""
