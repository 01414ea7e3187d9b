"""The block pool: null block, ref counts, free order, lazy eviction, reset (behaviour §3)."""

from __future__ import annotations

import pytest

from blockserve.core.block_pool import BlockPool
from blockserve.core.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventRecorder
from blockserve.errors import InvalidConfigError, NoFreeBlocksError
from tests.core.helpers import (
    HASHER,
    admit,
    assert_manager_integrity,
    assert_pool_integrity,
    make_manager,
    make_request,
    uint64,
)


def make_pool(num_blocks: int = 11) -> BlockPool:
    return BlockPool(num_blocks, block_size=4, events=KVEventRecorder())


def test_null_block_is_never_handed_out() -> None:
    """N blocks give N-1 usable ones: block 0 is the null block."""
    pool = make_pool(11)
    assert pool.num_usable_blocks == 10
    assert pool.num_free_blocks == 10
    blocks = pool.get_new_blocks(10)
    assert [b.block_id for b in blocks] == [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    assert all(b.ref_cnt == 1 for b in blocks)
    assert pool.null_block.block_id == 0 and pool.null_block.ref_cnt == 0
    assert_pool_integrity(pool)


def test_asking_for_too_many_blocks_changes_nothing() -> None:
    """get_new_blocks beyond the free count raises NoFreeBlocksError and mutates nothing."""
    pool = make_pool(11)
    pool.get_new_blocks(3)
    with pytest.raises(NoFreeBlocksError, match="asked for 8 blocks, 7 free"):
        pool.get_new_blocks(8)
    assert pool.free_block_queue.block_ids() == [4, 5, 6, 7, 8, 9, 10]
    assert_pool_integrity(pool)


@pytest.mark.parametrize(
    ("num_blocks", "block_size"), [(1, 4), (0, 4), (11, 0), (11, -4), (11, 2.0)]
)
def test_bad_geometry_is_rejected(num_blocks: int, block_size: int) -> None:
    """A pool needs at least 2 blocks and a positive integer block size."""
    with pytest.raises(InvalidConfigError):
        BlockPool(num_blocks, block_size)


def test_usage_counts_cached_free_blocks_as_free() -> None:
    """usage = 1 - free / (N-1); a freed block that stays cached is free."""
    manager = make_manager(11)
    request = make_request("a", range(16))
    admit(manager, request)
    assert manager.usage == pytest.approx(0.4)
    manager.free(request)
    assert manager.usage == 0.0
    assert len(manager.block_pool.cached_block_hash_to_block) == 4
    assert_manager_integrity(manager)


def test_shared_blocks_are_ref_counted() -> None:
    """Two running requests share 2 prefix blocks at ref_cnt 2; one finishing leaves them at 1."""
    manager = make_manager(11)
    pool = manager.block_pool
    first = make_request("a", range(10))  # blocks 0-1 full, block 2 partial
    second = make_request("b", [*range(8), 97, 98, 99])
    assert admit(manager, first) == 0
    assert admit(manager, second) == 8
    assert manager.get_block_ids("a") == [1, 2, 3]
    assert manager.get_block_ids("b") == [1, 2, 4]
    assert [pool.blocks[i].ref_cnt for i in (1, 2, 3, 4)] == [2, 2, 1, 1]
    manager.free(first)
    assert [pool.blocks[i].ref_cnt for i in (1, 2, 3, 4)] == [1, 1, 0, 1]
    assert pool.free_block_queue.block_ids() == [3, 5, 6, 7, 8, 9, 10]
    assert_manager_integrity(manager)


def test_free_order_partial_to_head_hashed_tail_first() -> None:
    """A finished request's partial tail goes to the head; b2, b1, b0 go to the tail in order."""
    manager = make_manager(11)
    request = make_request("a", range(14))  # b0 b1 b2 full, t partial
    admit(manager, request)
    assert manager.get_block_ids("a") == [1, 2, 3, 4]
    manager.free(request)
    assert manager.block_pool.free_block_queue.block_ids() == [4, 5, 6, 7, 8, 9, 10, 3, 2, 1]
    assert_manager_integrity(manager)


def test_hit_on_free_block_removes_it_from_the_middle() -> None:
    """A hit takes a free cached block out of the queue and raises its ref_cnt; nothing evicted."""
    pool = make_pool(11)
    request = make_request("a", range(12))
    blocks = pool.get_new_blocks(3)
    pool.cache_full_blocks(request, blocks, 0, 3)
    pool.free_blocks(reversed(blocks))
    assert pool.free_block_queue.block_ids() == [4, 5, 6, 7, 8, 9, 10, 3, 2, 1]
    pool.take_events()
    hit = pool.get_cached_block(request.block_hashes[1])
    assert hit is blocks[1]
    pool.touch([hit])
    assert hit.ref_cnt == 1 and hit.block_hash == request.block_hashes[1]
    assert pool.free_block_queue.block_ids() == [4, 5, 6, 7, 8, 9, 10, 3, 1]
    assert pool.take_events() == []
    pool.free_blocks([hit])
    assert pool.free_block_queue.block_ids() == [4, 5, 6, 7, 8, 9, 10, 3, 1, 2]
    assert_pool_integrity(pool)


def test_eviction_is_lazy_and_emits_block_removed() -> None:
    """A freed cached block keeps its hash until handed out; then BlockRemoved([hash])."""
    pool = make_pool(11)
    request = make_request("a", range(12))
    blocks = pool.get_new_blocks(3)
    pool.cache_full_blocks(request, blocks, 0, 3)
    pool.free_blocks(reversed(blocks))
    pool.take_events()
    assert [b.block_id for b in pool.get_new_blocks(7)] == [4, 5, 6, 7, 8, 9, 10]
    assert pool.take_events() == []
    assert blocks[2].block_hash == request.block_hashes[2]
    (evicted,) = pool.get_new_blocks(1)
    assert evicted is blocks[2] and evicted.block_hash is None
    assert pool.get_cached_block(request.block_hashes[2]) is None
    assert pool.take_events() == [
        BlockRemoved(block_hashes=[uint64(request.block_hashes[2])], medium="GPU")
    ]
    assert_pool_integrity(pool)


def test_one_hash_two_blocks_removed_with_the_last() -> None:
    """A block recomputed under a cached hash is mapped too; BlockRemoved waits for the last."""
    manager = make_manager(11)
    pool = manager.block_pool
    first = make_request("a", range(8))
    admit(manager, first)
    manager.free(first)  # queue: 3..10, then b1 (block 2), b0 (block 1)
    second = make_request("b", range(8))
    assert admit(manager, second) == 4  # 8 tokens: the last is never a hit, so block 1 recomputed
    assert manager.get_block_ids("b") == [1, 3]
    h0, h1 = second.block_hashes
    assert {b.block_id for _, b in pool.cached_block_hash_to_block.items()} == {1, 2, 3}
    events = manager.take_events()
    assert events[-1] == BlockStored(
        block_hashes=[uint64(h1)],
        parent_block_hash=uint64(h0),
        token_ids=[4, 5, 6, 7],
        block_size=4,
        lora_id=None,
        medium="GPU",
        lora_name=None,
        extra_keys=[None],  # one entry a block, as vLLM 0.32 publishes them
    )
    manager.free(second)
    assert pool.free_block_queue.block_ids() == [4, 5, 6, 7, 8, 9, 10, 2, 3, 1]
    pool.get_new_blocks(8)  # evicts block 2: block 3 still holds h1, so no event
    assert manager.take_events() == []
    assert pool.get_cached_block(h1) is pool.blocks[3]
    pool.get_new_blocks(1)  # evicts block 3, the last copy of h1
    assert manager.take_events() == [BlockRemoved(block_hashes=[uint64(h1)], medium="GPU")]
    assert_pool_integrity(pool)


def test_reset_fails_while_blocks_are_held() -> None:
    """reset_prefix_cache returns False, changing nothing, while a request holds blocks."""
    manager = make_manager(11)
    request = make_request("a", range(9))
    admit(manager, request)
    manager.take_events()
    assert manager.reset_prefix_cache() is False
    assert len(manager.block_pool.cached_block_hash_to_block) == 2
    assert manager.take_events() == []
    assert_manager_integrity(manager)


def test_reset_clears_every_hash() -> None:
    """A successful reset drops every hash, emits AllBlocksCleared, and the next request misses."""
    manager = make_manager(11)
    request = make_request("a", range(9))
    admit(manager, request)
    manager.free(request)
    manager.take_events()
    assert manager.reset_prefix_cache() is True
    assert len(manager.block_pool.cached_block_hash_to_block) == 0
    assert all(b.block_hash is None for b in manager.block_pool.blocks)
    assert manager.take_events() == [AllBlocksCleared()]
    assert admit(manager, make_request("b", range(9))) == 0
    assert_manager_integrity(manager)


def test_touch_and_free_skip_the_null_block() -> None:
    """The null block is never queued, counted or freed."""
    pool = make_pool(5)
    pool.touch([pool.null_block])
    pool.free_blocks([pool.null_block, pool.null_block])
    assert pool.null_block.ref_cnt == 0
    assert pool.free_block_queue.block_ids() == [1, 2, 3, 4]
    assert_pool_integrity(pool)


def test_integrity_check_reports_corruption() -> None:
    """The integrity check fails on a held block left in the queue and on a stray hash."""
    manager = make_manager(11)
    admit(manager, make_request("a", range(9)))
    pool = manager.block_pool
    assert manager.integrity_errors() == []
    pool.blocks[1].ref_cnt = 0  # held, but claims no holder
    pool.blocks[7].block_hash = HASHER.hash_block(None, [1, 2, 3, 4])  # hashed, not mapped
    errors = manager.integrity_errors()
    assert "block 1: ref_cnt 0, not in the free queue" in errors
    assert "3 hashed blocks but 2 hash map entries" in errors
    assert "block 1: ref_cnt 0, held by 1 requests" in errors
