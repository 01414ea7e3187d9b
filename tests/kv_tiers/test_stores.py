"""Local tier stores: put/get/evict in LRU order, byte bounds, damaged disk blocks dropped; each
call says what it did (Read, Write), and the tier counts it."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from blockserve.kv_tiers.disk import DiskStore
from blockserve.kv_tiers.host import HostStore
from blockserve.kv_tiers.store import BlockShape, LocalStore, Read, Tier, Write

SHAPE = BlockShape(num_layers=2, block_size=4, num_kv_heads=2, head_dim=8, dtype=torch.float32)
THREE_BLOCKS = 3 * SHAPE.nbytes


def block(seed: int) -> torch.Tensor:
    return torch.randn(SHAPE.shape, generator=torch.Generator().manual_seed(seed))


def key(i: int) -> bytes:
    return bytes([i]) * 32


StoreFactory = Callable[[int], LocalStore]


@pytest.fixture(params=["host", "disk"])
def make_store(request: pytest.FixtureRequest, tmp_path: Path) -> StoreFactory:
    def make(capacity_bytes: int) -> LocalStore:
        if request.param == "host":
            return HostStore(SHAPE, capacity_bytes)
        return DiskStore(tmp_path / "tier", SHAPE, capacity_bytes)

    return make


def test_put_then_get_returns_the_same_block(make_store: StoreFactory) -> None:
    """The tier counts what the calls returned: a store, a hit, a miss."""
    tier = Tier("t", "CPU", make_store(THREE_BLOCKS))
    store = tier.store
    assert tier.put(key(1), block(1)) == Write(stored=True)
    got = tier.get(key(1)).block
    assert got is not None and torch.equal(got, block(1))
    assert tier.get(key(2)) == Read()
    assert (tier.stats.hits, tier.stats.misses, tier.stats.stores) == (1, 1, 1)
    assert key(1) in store and len(store) == 1 and store.used_bytes == SHAPE.nbytes


def test_least_recently_used_goes_first_and_the_bound_holds(make_store: StoreFactory) -> None:
    """Capacity three blocks: a get refreshes its key, so the fourth put evicts key 2."""
    store = make_store(THREE_BLOCKS + SHAPE.nbytes - 1)  # a partial block's bytes buy nothing
    tier = Tier("t", "CPU", store)
    for i in (1, 2, 3):
        tier.put(key(i), block(i))
    assert store.get(key(1)).block is not None
    assert tier.put(key(4), block(4)) == Write(stored=True, evicted=(key(2),))
    assert store.keys() == [key(3), key(1), key(4)]
    assert store.used_bytes == THREE_BLOCKS and tier.stats.evictions == 1


def test_a_key_already_held_is_not_written_again(make_store: StoreFactory) -> None:
    store = make_store(THREE_BLOCKS)
    store.put(key(1), block(1))
    store.put(key(2), block(2))
    assert store.put(key(1), block(9)) == Write()  # refreshed, not rewritten
    got = store.get(key(1)).block
    assert got is not None and torch.equal(got, block(1))
    assert store.keys() == [key(2), key(1)]


def test_remove_and_a_zero_capacity(make_store: StoreFactory) -> None:
    store = make_store(THREE_BLOCKS)
    store.put(key(1), block(1))
    assert store.remove(key(1)) and not store.remove(key(1))
    assert store.get(key(1)) == Read() and len(store) == 0
    empty = make_store(SHAPE.nbytes - 1)
    assert empty.put(key(1), block(1)) == Write() and len(empty) == 0


def test_a_block_of_the_wrong_shape_or_dtype_is_refused(make_store: StoreFactory) -> None:
    store = make_store(THREE_BLOCKS)
    with pytest.raises(ValueError, match="this store holds"):
        store.put(key(1), block(1)[:1])
    with pytest.raises(ValueError, match="this store holds"):
        store.put(key(1), block(1).to(torch.bfloat16))
    assert len(store) == 0


def disk_file(store: DiskStore, i: int) -> Path:
    (path,) = (store.root / "blocks").glob(f"*/{key(i).hex()}.kv")
    return path


def test_a_flipped_byte_is_detected_and_dropped(tmp_path: Path) -> None:
    store = DiskStore(tmp_path, SHAPE, THREE_BLOCKS)
    store.put(key(1), block(1))
    path = disk_file(store, 1)
    data = bytearray(path.read_bytes())
    data[100] ^= 0x01
    path.write_bytes(bytes(data))
    assert store.get(key(1)) == Read(damaged=True)
    assert not path.exists() and key(1) not in store


def test_a_truncated_file_is_detected_on_read_and_on_open(tmp_path: Path) -> None:
    store = DiskStore(tmp_path, SHAPE, THREE_BLOCKS)
    store.put(key(1), block(1))
    store.put(key(2), block(2))
    for i in (1, 2):
        path = disk_file(store, i)
        path.write_bytes(path.read_bytes()[:-7])
    assert store.get(key(1)) == Read(damaged=True)
    reopened = DiskStore(tmp_path, SHAPE, THREE_BLOCKS)  # key 2 is caught before any read
    assert len(reopened) == 0 and reopened.damaged_on_open == 1


def test_reopening_keeps_the_blocks_and_their_order(tmp_path: Path) -> None:
    """A second store on the directory (a restart) finds every block, in LRU order, and drops
    the temporary file a killed writer left behind."""
    store = DiskStore(tmp_path, SHAPE, THREE_BLOCKS)
    for i in (1, 2, 3):
        store.put(key(i), block(i))
    assert store.get(key(1)) is not None  # key 1 becomes the most recent
    leftover = disk_file(store, 2).with_name("torn.kv.tmp123-0")
    leftover.write_bytes(b"half a block")
    reopened = DiskStore(tmp_path, SHAPE, THREE_BLOCKS)
    assert reopened.keys() == [key(2), key(3), key(1)]
    assert not leftover.exists()
    for i in (1, 2, 3):
        got = reopened.get(key(i)).block
        assert got is not None and torch.equal(got, block(i))


def test_reopening_with_less_room_evicts_the_oldest(tmp_path: Path) -> None:
    store = DiskStore(tmp_path, SHAPE, THREE_BLOCKS)
    for i in (1, 2, 3):
        store.put(key(i), block(i))
    smaller = DiskStore(tmp_path, SHAPE, SHAPE.nbytes)
    assert smaller.keys() == [key(3)]
    assert sorted(p.name for p in (tmp_path / "blocks").glob("*/*")) == [f"{key(3).hex()}.kv"]


def test_writes_go_through_a_temporary_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The final name appears only by rename: a writer killed before it leaves no block."""
    renames: list[tuple[str, str]] = []
    real_replace = os.replace

    def record(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
        renames.append((Path(src).name, Path(dst).name))
        assert not Path(dst).exists()
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", record)
    DiskStore(tmp_path, SHAPE, THREE_BLOCKS).put(key(1), block(1))
    ((temp, final),) = renames
    assert final == f"{key(1).hex()}.kv" and temp.startswith(f"{final}.tmp")
