"""`KVTiers` on small KV tensors: blocks copied down after a step, loaded back in order,
damaged blocks never loaded, and every store and removal told as an event with its medium."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from blockserve.bench.redis_server import RedisServer
from blockserve.core.events import BlockRemoved, BlockStored
from blockserve.core.hashing import BlockHash
from blockserve.kv_tiers.disk import DiskStore
from blockserve.kv_tiers.host import HostStore
from blockserve.kv_tiers.offload import KVTiers
from blockserve.kv_tiers.remote import RemoteStore
from blockserve.kv_tiers.store import BlockShape, FilledBlock, Tier

SHAPE = BlockShape(num_layers=2, block_size=4, num_kv_heads=2, head_dim=8, dtype=torch.float32)
NUM_BLOCKS = 8


def kv_caches(seed: int) -> list[torch.Tensor]:
    """Per layer [2, blocks, block_size, heads, head_dim], random."""
    generator = torch.Generator().manual_seed(seed)
    shape = (2, NUM_BLOCKS, SHAPE.block_size, SHAPE.num_kv_heads, SHAPE.head_dim)
    return [torch.randn(shape, generator=generator) for _ in range(SHAPE.num_layers)]


def block_of(caches: list[torch.Tensor], block_id: int) -> torch.Tensor:
    return torch.stack([kv[:, block_id] for kv in caches])


def key(i: int) -> BlockHash:
    return BlockHash(bytes([i]) * 32)


def filled(block_id: int, i: int, parent: int | None = None) -> FilledBlock:
    parent_hash = key(parent) if parent is not None else None
    return FilledBlock(block_id, key(i), parent_hash, (i, i, i, i))


@pytest.fixture
def tiers(tmp_path: Path) -> Iterator[KVTiers]:
    host = Tier("host", "CPU", HostStore(SHAPE, 2 * SHAPE.nbytes))
    disk = Tier("disk", "DISK", DiskStore(tmp_path / "disk", SHAPE, 4 * SHAPE.nbytes))
    made = KVTiers([host, disk], kv_caches(0), SHAPE.block_size, events_hash_format="bytes")
    yield made
    made.close()


def load(tiers: KVTiers, keys: list[BlockHash], block_ids: list[int]) -> int:
    tiers.start_load("r", keys, block_ids)
    for _ in range(200):  # 10 s at most
        finished = tiers.finished_loads()
        if finished:
            return finished["r"]
        tiers.wait_for_loads(0.05)
    raise AssertionError("the load did not finish")


def test_blocks_go_down_to_every_tier_and_come_back_bit_exact(tiers: KVTiers) -> None:
    """...and each block loaded into the caches is told to `on_write` (the attention backend
    drops what it kept of the caches)."""
    writes: list[None] = []
    tiers.on_write = lambda: writes.append(None)
    source = [kv.clone() for kv in tiers.kv_caches]
    tiers.store([filled(1, 1), filled(2, 2, parent=1)])
    assert tiers.flush(10.0)
    assert [t.store.keys() for t in tiers.tiers] == [[key(1), key(2)]] * 2
    for kv in tiers.kv_caches:
        kv.zero_()
    assert tiers.lookup([key(1), key(2), key(3)]) == ["host", "host"]
    assert load(tiers, [key(1), key(2)], [5, 6]) == 2
    assert torch.equal(block_of(tiers.kv_caches, 5), block_of(source, 1))
    assert torch.equal(block_of(tiers.kv_caches, 6), block_of(source, 2))
    assert len(writes) == 2


def test_a_block_every_tier_holds_is_not_copied_again(tiers: KVTiers) -> None:
    tiers.store([filled(1, 1)])
    assert tiers.flush(10.0)
    tiers.store([filled(3, 1), filled(4, 4)])
    assert tiers.flush(10.0)
    assert [t.stats.stores for t in tiers.tiers] == [2, 2]


def test_the_disk_serves_what_the_host_evicted_and_promotes_it(tiers: KVTiers) -> None:
    """Host holds 2, disk 4: after 3 blocks the host lost block 1; a load reads it from disk
    and puts it back in the host (evicting the least recent there)."""
    tiers.store([filled(1, 1), filled(2, 2, 1), filled(3, 3, 2)])
    assert tiers.flush(10.0)
    assert tiers.lookup([key(1), key(2), key(3)]) == ["disk", "host", "host"]
    assert load(tiers, [key(1)], [7]) == 1
    host, disk = tiers.tiers
    assert (host.store.keys(), disk.stats.hits) == ([key(3), key(1)], 1)


def test_a_damaged_block_ends_the_load_there(tiers: KVTiers, tmp_path: Path) -> None:
    """Blocks 1-3 on disk only, block 2's file flipped: the load brings block 1 and stops."""
    host, disk = tiers.tiers
    tiers.store([filled(1, 1), filled(2, 2, 1), filled(3, 3, 2)])
    assert tiers.flush(10.0)
    for k in (key(1), key(2), key(3)):
        host.store.remove(k)
    assert isinstance(disk.store, DiskStore)
    path = disk.store._path(key(2))
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    tiers.take_events()
    assert load(tiers, [key(1), key(2), key(3)], [5, 6, 7]) == 1
    assert key(2) not in disk.store and disk.stats.corrupt == 1
    removed = [e for e in tiers.take_events() if isinstance(e, BlockRemoved)]
    assert [(e.block_hashes, e.medium) for e in removed] == [([key(2)], "DISK")]


def test_events_name_the_tier_and_match_what_each_tier_holds(tiers: KVTiers) -> None:
    """Stores and evictions, replayed in order, give exactly each tier's keys."""
    for i in range(1, 7):
        tiers.store([filled(i, i, i - 1 if i > 1 else None)])
    assert tiers.flush(10.0)
    events = tiers.take_events()
    held: dict[str, set[bytes]] = {"CPU": set(), "DISK": set()}
    for event in events:
        assert isinstance(event, (BlockStored, BlockRemoved)) and event.medium is not None
        hashes = {bytes(h) for h in event.block_hashes}  # type: ignore[arg-type]
        if isinstance(event, BlockStored):
            held[event.medium] |= hashes
        else:
            held[event.medium] -= hashes
    host, disk = tiers.tiers
    assert held == {"CPU": set(host.store.keys()), "DISK": set(disk.store.keys())}
    assert len(held["CPU"]) == 2 and len(held["DISK"]) == 4
    stored = [e for e in events if isinstance(e, BlockStored) and e.medium == "DISK"]
    assert (stored[1].parent_block_hash, stored[1].token_ids) == (key(1), [2, 2, 2, 2])


def test_writes_beyond_the_queue_bound_are_dropped_and_counted(tmp_path: Path) -> None:
    host = Tier("host", "CPU", HostStore(SHAPE, 8 * SHAPE.nbytes))
    tiers = KVTiers([host], kv_caches(0), SHAPE.block_size, max_pending_bytes=SHAPE.nbytes)
    try:
        # One call, one block of room: the first is queued, the other two dropped.
        tiers.store([filled(1, 1), filled(2, 2), filled(3, 3)])
        assert tiers.flush(10.0)
        assert (tiers.num_dropped_writes, host.store.keys()) == (2, [key(1)])
    finally:
        tiers.close()


def test_a_cancelled_load_is_never_reported(tiers: KVTiers) -> None:
    tiers.store([filled(1, 1)])
    assert tiers.flush(10.0)
    tiers.start_load("r", [key(1)], [5])
    tiers.cancel_load("r")
    tiers.wait_for_loads(0.2)
    assert tiers.finished_loads() == {}


def test_a_shared_tier_is_fed_and_read_and_skipped_while_down(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    """Host over a real Redis store: a filled block reaches both; a block only the store holds
    loads from it (and joins the host); once the store is down, a step's blocks are copied out
    for the host alone and the store is not tried again."""
    remote = RemoteStore(redis_server.url, SHAPE, namespace="offload")
    host = Tier("host", "CPU", HostStore(SHAPE, 4 * SHAPE.nbytes))
    shared = Tier("remote", "REMOTE", remote)
    made = KVTiers([host], kv_caches(0), SHAPE.block_size, shared=shared)
    try:
        made.store([filled(1, 1)])
        assert made.flush(10.0) and shared.stats.stores == 1 and key(1) in host.store
        host.store.remove(key(1))
        assert made.lookup([key(1), key(2)]) == ["remote"]
        assert load(made, [key(1)], [5]) == 1 and key(1) in host.store
        assert torch.equal(block_of(made.kv_caches, 5), block_of(kv_caches(0), 1))
        redis_server.stop()
        assert made.lookup([key(3)]) == [] and remote.is_down and remote.failures == 1
        made.store([filled(3, 3)])
        assert made.flush(10.0) and key(3) in host.store
        assert (shared.stats.stores, remote.failures) == (1, 1)
    finally:
        made.close()
        remote.close()
