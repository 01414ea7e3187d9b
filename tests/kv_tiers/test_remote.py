"""The shared tier's store against a real Redis server: blocks round-trip bit for bit, one
namespace never reads another's, a damaged or truncated value is a miss and is deleted, and a
server that stops, pauses or restarts changes speed, never an answer; its URL's scheme picks it."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from blockserve.bench.redis_server import RedisServer
from blockserve.kv_tiers.remote import (
    FIRST_BACKOFF_S,
    LOOKUP_TIMEOUT_S,
    TAG_BYTES,
    RemoteStore,
    redacted,
)
from blockserve.kv_tiers.shared import open_shared_store
from blockserve.kv_tiers.store import RECORD_HEADER, BlockShape, Read, Tier, Write, pack_block

SHAPE = BlockShape(num_layers=2, block_size=4, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16)


def block(seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(SHAPE.shape, generator=generator).to(SHAPE.dtype)


@pytest.fixture
def store(redis_server: RedisServer) -> Iterator[RemoteStore]:
    remote = RemoteStore(redis_server.url, SHAPE, namespace="ns-a")
    yield remote
    remote.close()


def test_blocks_round_trip_bit_for_bit(store: RemoteStore) -> None:
    """Through a tier, which counts what each call returned."""
    tier = Tier("remote", "REMOTE", store)
    keys = [bytes([i]) * 32 for i in range(3)]
    for i, key in enumerate(keys):
        assert tier.put(key, block(i)) == Write(stored=True)
    assert store.contains_many([*keys, b"x" * 32]) == [True, True, True, False]
    for i, key in enumerate(keys):
        got = tier.get(key).block
        assert got is not None and torch.equal(got, block(i))
    assert tier.get(b"x" * 32) == Read()
    # Held already (by any replica): not written again.
    assert tier.put(keys[0], block(9)) == Write(stored=False)
    assert torch.equal(tier.get(keys[0]).block, block(0))  # type: ignore[arg-type]
    stats = tier.stats
    assert (stats.stores, stats.hits, stats.misses, store.used_bytes) == (3, 4, 1, 3 * SHAPE.nbytes)


def test_the_urls_scheme_picks_the_store(redis_server: RedisServer) -> None:
    store = open_shared_store(redis_server.url, SHAPE, "ns-o")
    assert isinstance(store, RemoteStore) and store.namespace == "ns-o"
    store.close()
    with pytest.raises(ValueError, match="no shared KV store serves memcached:// URLs"):
        open_shared_store("memcached://host", SHAPE, "ns")


def test_a_namespace_never_reads_another(store: RemoteStore, redis_server: RedisServer) -> None:
    other = RemoteStore(redis_server.url, SHAPE, namespace="ns-b")
    key = b"k" * 32
    store.put(key, block(1))
    assert other.contains_many([key]) == [False] and other.get(key) == Read()
    other.put(key, block(2))
    assert torch.equal(store.get(key).block, block(1))  # type: ignore[arg-type]
    assert torch.equal(other.get(key).block, block(2))  # type: ignore[arg-type]
    other.close()


@pytest.mark.parametrize("damage", ["flip", "truncate", "header"])
def test_a_damaged_value_is_a_miss_and_is_deleted(
    store: RemoteStore, redis_server: RedisServer, damage: str
) -> None:
    key = b"d" * 32
    store.put(key, block(3))
    client = redis_server.client()
    value = bytearray(client.get(store.key(key)))  # type: ignore[arg-type]
    if damage == "flip":
        value[-1] ^= 0xFF
    elif damage == "truncate":
        value = value[:-10]
    else:
        value[0:4] = b"XXXX"
    client.set(store.key(key), bytes(value))
    assert store.get(key) == Read(damaged=True)
    assert client.exists(store.key(key)) == 0


@pytest.mark.slow
def test_a_stopped_store_is_marked_down_and_comes_back(
    store: RemoteStore, redis_server: RedisServer
) -> None:
    key = b"s" * 32
    store.put(key, block(4))
    redis_server.stop()
    assert store.contains_many([key]) == [False]
    assert store.is_down and store.failures == 1
    assert store.get(key) == Read() and store.put(b"t" * 32, block(5)) == Write()
    assert store.failures == 1  # while down, nothing is tried
    redis_server.start()  # the same port, empty (no persistence)
    time.sleep(FIRST_BACKOFF_S + 0.1)
    assert not store.is_down
    assert store.contains_many([key]) == [False]  # the restart lost it: a miss, no error
    store.put(key, block(4))
    assert torch.equal(store.get(key).block, block(4))  # type: ignore[arg-type]


def test_the_start_check_says_whether_the_store_answers(
    store: RemoteStore, redis_server: RedisServer
) -> None:
    """check() PINGs: None while the server runs, the client's error once it stopped (and a
    failed check marks nothing down: it is the start's question, not a lookup)."""
    assert store.check() is None
    redis_server.stop()
    problem = store.check()
    assert problem is not None and problem.startswith("ConnectionError: ")
    assert not store.is_down and store.failures == 0


def test_a_paused_store_costs_a_lookup_its_timeout_only(
    store: RemoteStore, redis_server: RedisServer
) -> None:
    key = b"p" * 32
    store.put(key, block(6))
    redis_server.pause()
    try:
        started = time.perf_counter()
        assert store.contains_many([key]) == [False]
        first = time.perf_counter() - started
        started = time.perf_counter()
        assert store.contains_many([key]) == [False]  # marked down: not asked
        second = time.perf_counter() - started
    finally:
        redis_server.resume()
    assert first < LOOKUP_TIMEOUT_S + 0.25 and second < 0.005
    assert store.is_down and store.failures == 1


def test_a_refused_password_reads_as_a_down_store(tmp_path: Path) -> None:
    server = RedisServer(tmp_path, password="secret")
    try:
        wrong = RemoteStore(server.url.replace(":secret@", ":wrong@"), SHAPE, namespace="ns")
        assert wrong.url == f"redis://:***@127.0.0.1:{server.port}/0"  # what the logs show
        assert wrong.contains_many([b"k" * 32]) == [False]
        assert wrong.put(b"k" * 32, block(7)) == Write() and wrong.get(b"k" * 32) == Read()
        assert wrong.is_down and wrong.failures == 1 and wrong.used_bytes == 0
        right = RemoteStore(server.url, SHAPE, namespace="ns")
        right.put(b"k" * 32, block(7))
        assert torch.equal(right.get(b"k" * 32).block, block(7))  # type: ignore[arg-type]
        wrong.close()
        right.close()
    finally:
        server.stop()


@pytest.fixture
def signed(redis_server: RedisServer) -> Iterator[RemoteStore]:
    remote = RemoteStore(redis_server.url, SHAPE, namespace="ns-s", secret=b"shared")
    yield remote
    remote.close()


def rewritten(value: bytes, signed: bool) -> bytes:
    """`value` with its block's first byte changed and its checksum made good again: what
    someone who can write the store, but has no secret, can do."""
    tag = value[-TAG_BYTES:] if signed else b""
    record = bytearray(value[:-TAG_BYTES] if signed else value)
    payload = bytearray(record[RECORD_HEADER.size :])
    payload[0] ^= 0x55
    return pack_block(bytes(payload)) + tag


def test_unsigned_records_are_believed_and_the_log_says_so(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    """Without a secret a rewritten record (a fresh checksum) is served: the store is trusted,
    as the warning at start says."""
    with caplog.at_level("WARNING", logger="blockserve.kv_tiers.remote"):
        store = RemoteStore(redis_server.url, SHAPE, namespace="ns-u")
    assert [r.message for r in caplog.records] == [
        f"KV remote tier {redis_server.url}: no --kv-remote-secret, so its records are not "
        "signed: whoever can write the store answers for every replica"
    ]
    key = b"u" * 32
    store.put(key, block(1))
    client = redis_server.client()
    client.set(store.key(key), rewritten(client.get(store.key(key)), signed=False))  # type: ignore[arg-type]
    got = store.get(key).block
    assert got is not None and not torch.equal(got, block(1))
    store.close()


def test_a_signed_record_rewritten_or_moved_is_a_miss_and_is_deleted(
    signed: RemoteStore, redis_server: RedisServer
) -> None:
    """With the secret: a record rewritten with a fresh checksum, or copied onto another
    prompt's key, fails its signature: a miss, deleted, and the next write lands."""
    one, two = b"1" * 32, b"2" * 32
    signed.put(one, block(1))
    signed.put(two, block(2))
    client = redis_server.client()
    client.set(signed.key(one), rewritten(client.get(signed.key(one)), signed=True))  # type: ignore[arg-type]
    client.set(signed.key(two), client.get(signed.key(one)))  # another key's record
    assert signed.contains_many([one, two]) == [True, True]  # a lookup reads lengths only
    assert signed.get(one) == Read(damaged=True) and signed.get(two) == Read(damaged=True)
    assert client.exists(signed.key(one), signed.key(two)) == 0
    signed.put(one, block(1))
    assert torch.equal(signed.get(one).block, block(1))  # type: ignore[arg-type]


def test_a_value_of_another_size_is_never_read(
    signed: RemoteStore, redis_server: RedisServer
) -> None:
    """A 64 MiB value under a block's key: the lookup says absent (its length), a read takes
    at most a record's bytes, counts it corrupt and deletes it."""
    key = b"h" * 32
    client = redis_server.client()
    client.set(signed.key(key), b"\0" * (64 << 20))
    assert signed.contains_many([key]) == [False]
    assert signed.get(key) == Read(damaged=True)
    assert client.exists(signed.key(key)) == 0


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://:pw@host:6379/0", "redis://:***@host:6379/0"),
        ("redis://user:p@ss@host:6379", "redis://user:***@host:6379"),
        ("redis://host:6379/0?password=pw&db=1", "redis://host:6379/0?password=***&db=1"),
        ("unix:///tmp/r.sock?password=pw", "unix:///tmp/r.sock?password=***"),
        ("redis://:pw@[::1", "<a URL that does not parse>"),
    ],
)
def test_urls_are_logged_without_their_password(url: str, shown: str) -> None:
    assert redacted(url) == shown
