"""KV event structs on vLLM's wire format (docs/behaviour.md §5 items 23-24)."""

from __future__ import annotations

import msgspec
import pytest

from blockserve.core.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    KVEventRecorder,
    decode_batch,
    encode_batch,
)
from blockserve.core.hashing import BlockHash
from blockserve.errors import InvalidConfigError

STORED = BlockStored(
    block_hashes=[11, 12],
    parent_block_hash=None,
    token_ids=list(range(32)),
    block_size=16,
    lora_id=None,
    medium="GPU",
    lora_name=None,
)


def test_batch_is_an_array_and_events_are_tagged_maps() -> None:
    """A batch encodes as [ts, [events], dp_rank]; events as maps with "type" first."""
    batch = KVEventBatch(
        ts=1.5,
        events=[STORED, BlockRemoved(block_hashes=[12], medium="GPU"), AllBlocksCleared()],
        data_parallel_rank=0,
    )
    decoded = msgspec.msgpack.decode(encode_batch(batch))
    assert decoded == [
        1.5,
        [
            {
                "type": "BlockStored",
                "block_hashes": [11, 12],
                "parent_block_hash": None,
                "token_ids": list(range(32)),
                "block_size": 16,
                "lora_id": None,
                "medium": "GPU",
                "lora_name": None,
            },
            {"type": "BlockRemoved", "block_hashes": [12], "medium": "GPU"},
            {"type": "AllBlocksCleared"},
        ],
        0,
    ]
    assert list(decoded[1][0]) == [
        "type",
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
    ]


def test_defaulted_fields_are_omitted() -> None:
    """Event fields at their defaults are left off; a batch array keeps all three slots."""
    payload = encode_batch(KVEventBatch(ts=0.0, events=[AllBlocksCleared()]))
    assert msgspec.msgpack.decode(payload) == [0.0, [{"type": "AllBlocksCleared"}], None]
    with_group = BlockRemoved(block_hashes=[1], medium="GPU", group_idx=2)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(with_group)) == {
        "type": "BlockRemoved",
        "block_hashes": [1],
        "medium": "GPU",
        "group_idx": 2,
    }


def test_round_trip() -> None:
    """decode_batch reads back exactly what encode_batch wrote."""
    batch = KVEventBatch(ts=2.25, events=[STORED, AllBlocksCleared()], data_parallel_rank=0)
    assert decode_batch(encode_batch(batch)) == batch


def test_recorder_converts_hashes_to_uint64() -> None:
    """By default hashes become the last 8 bytes of the digest, big-endian."""
    recorder = KVEventRecorder()
    digest = BlockHash(bytes(range(32)))
    parent = BlockHash(b"\xff" * 32)
    recorder.block_stored([digest], parent, [1, 2], 2, "adapter")
    recorder.block_removed(digest)
    expected_int = int.from_bytes(bytes(range(24, 32)), "big")
    assert recorder.take() == [
        BlockStored(
            block_hashes=[expected_int],
            parent_block_hash=2**64 - 1,
            token_ids=[1, 2],
            block_size=2,
            lora_id=None,
            medium="GPU",
            lora_name="adapter",
        ),
        BlockRemoved(block_hashes=[expected_int], medium="GPU"),
    ]
    assert recorder.take() == []


def test_recorder_can_send_raw_bytes() -> None:
    """hash_format="bytes" sends the digest itself."""
    recorder = KVEventRecorder(hash_format="bytes")
    recorder.block_removed(BlockHash(b"\x01" * 32))
    (event,) = recorder.take()
    assert event == BlockRemoved(block_hashes=[b"\x01" * 32], medium="GPU")
    batch = KVEventBatch(ts=0.0, events=[event], data_parallel_rank=0)
    assert decode_batch(encode_batch(batch)) == batch


def test_unknown_hash_format_is_rejected() -> None:
    """Only uint64 and bytes are wire forms."""
    with pytest.raises(InvalidConfigError, match="hash_format"):
        KVEventRecorder(hash_format="hex")  # type: ignore[arg-type]
