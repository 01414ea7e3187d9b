"""KV cache events on vLLM's wire format, and the recorder the block pool emits them into. Owns the
msgspec structs (`BlockStored`, `BlockRemoved`, `AllBlocksCleared`, `KVEventBatch`) and
`KVEventRecorder`. Decides nothing about when events happen (the block pool does) or how they
travel (blockserve/events/ publishes them)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal, Protocol

import msgspec

from blockserve.core.hashing import BlockHash, block_hash_to_uint64
from blockserve.errors import InvalidConfigError

# Wire format (msgpack): a batch is an array `[ts, [event, ...], data_parallel_rank]`; each event
# is a map tagged by class name, `{"type": "BlockStored", "block_hashes": [...], ...}`, with
# fields at their default omitted. Hashes travel as uint64 ints by default (the last 8 bytes of
# the digest, big-endian) or as the raw digest bytes.

ExternalBlockHash = int | bytes
MEDIUM_GPU = "GPU"
"""vLLM's medium name for the primary KV tier (used on every device, as vLLM does)."""
MEDIUM_REMOTE = "REMOTE"
"""Ours: the medium of the KV tier every replica shares (--kv-remote-url)."""


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """A timestamped batch of events, encoded as an array."""

    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of the KV cache events: encoded as maps with `"type": <class name>`."""


class BlockStored(KVCacheEvent):
    """Consecutive blocks of one request newly registered in the prefix cache."""

    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None


class BlockRemoved(KVCacheEvent):
    """Hashes no longer present in the prefix cache (evicted)."""

    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    """The whole prefix cache was reset."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(EventBatch):
    """One engine step's KV events."""

    events: list[KVEvent]


HashFormat = Literal["uint64", "bytes"]


class CacheListener(Protocol):
    """Told, in process, of the changes the wire events describe: which hashes entered or left
    the prefix cache. Called synchronously inside the pool's mutation, after it is complete;
    a listener must not call back into the pool."""

    def on_hashes_stored(
        self,
        block_hashes: Sequence[BlockHash],
        parent_block_hash: BlockHash | None,
        token_ids: Sequence[int],
        cache_salt: str | None,
    ) -> None:
        """`block_hashes`, one request's consecutive blocks holding `token_ids`, can now be
        hit; `parent_block_hash` is the hash before them (None: they start at block 0);
        `cache_salt` is the storing request's namespace."""

    def on_hash_removed(self, block_hash: BlockHash) -> None:
        """The last block holding `block_hash` was evicted: it can no longer be hit."""

    def on_cache_cleared(self) -> None:
        """Every hash was forgotten (a prefix-cache reset)."""


class KVEventRecorder:
    """Collects the events a block pool emits until they are drained with `take()`.

    Converts block hashes to their external form once, at emission: uint64 ints by default
    (what vLLM sends and routers index), or the raw digest bytes.
    """

    __slots__ = ("_events", "hash_format", "medium")

    def __init__(self, hash_format: HashFormat = "uint64", medium: str = MEDIUM_GPU) -> None:
        if hash_format not in ("uint64", "bytes"):
            raise InvalidConfigError(
                f"hash_format must be 'uint64' or 'bytes', got {hash_format!r}"
            )
        self.hash_format = hash_format
        self.medium = medium
        self._events: list[KVEvent] = []

    def external_hash(self, block_hash: BlockHash) -> ExternalBlockHash:
        """The form a hash takes on the wire."""
        if self.hash_format == "uint64":
            return block_hash_to_uint64(block_hash)
        return bytes(block_hash)

    def block_stored(
        self,
        block_hashes: Sequence[BlockHash],
        parent_block_hash: BlockHash | None,
        token_ids: list[int],
        block_size: int,
        lora_name: str | None,
        extra_keys: list[tuple[Any, ...] | None] | None = None,
    ) -> None:
        """One `BlockStored`; `extra_keys`: one untagged entry a block, as vLLM publishes them
        (None for every block of a request without extra keys)."""
        to_external = self.external_hash
        self._events.append(
            BlockStored(
                block_hashes=[to_external(h) for h in block_hashes],
                parent_block_hash=(
                    None if parent_block_hash is None else to_external(parent_block_hash)
                ),
                token_ids=token_ids,
                block_size=block_size,
                lora_id=None,
                medium=self.medium,
                lora_name=lora_name,
                extra_keys=extra_keys,
            )
        )

    def block_removed(self, block_hash: BlockHash) -> None:
        self._events.append(
            BlockRemoved(block_hashes=[self.external_hash(block_hash)], medium=self.medium)
        )

    def all_blocks_cleared(self) -> None:
        self._events.append(AllBlocksCleared())

    def take(self) -> list[KVEvent]:
        """Drain and return the events recorded since the last call, oldest first."""
        events, self._events = self._events, []
        return events


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(KVEventBatch)


def encode_batch(batch: KVEventBatch) -> bytes:
    """The msgpack payload of one batch, as it goes on the wire."""
    return _ENCODER.encode(batch)


def decode_batch(payload: bytes) -> KVEventBatch:
    """Decode a payload produced by `encode_batch` (or by vLLM)."""
    return _DECODER.decode(payload)
