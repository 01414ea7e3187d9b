"""The KV cache manager: lookup, allocation, chunking, stats, events (behaviour §2, §5)."""

from __future__ import annotations

import dataclasses

import pytest

from blockserve.core.events import BlockStored
from blockserve.core.kv_cache_manager import KVCacheManager, PrefixCacheStats
from blockserve.errors import InvalidRequestError
from tests.core.helpers import (
    admit,
    assert_manager_integrity,
    make_manager,
    make_request,
    uint64,
)


def snapshot(manager: KVCacheManager) -> tuple[object, ...]:
    """Everything observable about a manager, to show a call changed nothing."""
    pool = manager.block_pool
    return (
        pool.free_block_queue.block_ids(),
        [(b.block_id, b.ref_cnt, b.block_hash) for b in pool.blocks],
        sorted((h, b.block_id) for h, b in pool.cached_block_hash_to_block.items()),
        {rid: [b.block_id for b in blocks] for rid, blocks in manager.req_to_blocks.items()},
        dict(manager.num_cached_blocks),
        dataclasses.replace(manager.prefix_cache_stats),  # a copy, not the live object
    )


@pytest.mark.parametrize(
    ("num_tokens", "expected_hits"), [(33, 32), (32, 16), (15, 0), (16, 0), (17, 16)]
)
def test_repeated_prompt_hits_all_but_the_last_token(num_tokens: int, expected_hits: int) -> None:
    """The hit is capped at num_tokens - 1, in whole blocks of 16."""
    manager = make_manager(num_blocks=20, block_size=16)
    first = make_request("a", range(num_tokens), block_size=16)
    assert admit(manager, first) == 0
    manager.free(first)
    second = make_request("b", range(num_tokens), block_size=16)
    assert manager.get_computed_blocks(second).num_hit_tokens == expected_hits
    assert admit(manager, second) == expected_hits
    assert_manager_integrity(manager)


def test_lookup_stops_at_first_miss() -> None:
    """A cached block after a missing one is not a hit: lookup stops at the first miss."""
    manager = make_manager(num_blocks=11)
    pool = manager.block_pool
    first = make_request("a", range(13))  # b0 b1 b2 cached in blocks 1 2 3, tail in block 4
    admit(manager, first)
    manager.free(first)  # queue: 4, 5..10, 3, 2, 1
    pool.touch([pool.blocks[3]])  # pin b2, then evict everything up to b1
    pool.get_new_blocks(8)
    assert pool.get_cached_block(first.block_hashes[2]) is pool.blocks[3]
    assert pool.get_cached_block(first.block_hashes[1]) is None
    hits = manager.get_computed_blocks(make_request("b", range(13)))
    assert [b.block_id for b in hits.blocks] == [1]
    assert hits.num_hit_tokens == 4


def test_blocks_registered_at_schedule_time() -> None:
    """Two identical 48-token requests in one step: the second hits the first's blocks 0-1."""
    manager = make_manager(num_blocks=20, block_size=16)
    first = make_request("a", range(48), block_size=16)
    second = make_request("b", range(48), block_size=16)
    assert admit(manager, first) == 0
    assert admit(manager, second) == 32
    assert manager.get_block_ids("a") == [1, 2, 3]
    assert manager.get_block_ids("b") == [1, 2, 4]
    assert_manager_integrity(manager)


def test_allocation_that_does_not_fit_mutates_nothing() -> None:
    """Free hit blocks count against the free pool: 3 new + 3 free hits > 5 free gives None."""
    manager = make_manager(num_blocks=6)  # 5 usable blocks of 4
    first = make_request("a", range(12))
    admit(manager, first)
    manager.free(first)  # blocks 1-3 are free and cached
    manager.take_events()
    second = make_request("b", [*range(12), *range(50, 59)])  # 21 tokens: 6 blocks, 3 hits
    hits = manager.get_computed_blocks(second)
    assert hits.num_hit_tokens == 12
    before = snapshot(manager)
    assert manager.allocate_slots(second, 9, 12, hits.blocks) is None
    assert snapshot(manager) == before
    assert manager.take_events() == []  # nothing cached, nothing evicted
    assert_manager_integrity(manager)


def test_held_hit_blocks_do_not_count_against_free_pool() -> None:
    """Hits on blocks another request holds cost no free blocks: 2 new blocks fit in 2 free."""
    manager = make_manager(num_blocks=6)
    first = make_request("a", range(12))
    admit(manager, first)
    second = make_request("b", [*range(12), 50, 51, 52, 53, 54])  # 17 tokens: 5 blocks, 3 hits
    assert admit(manager, second) == 12
    assert manager.get_block_ids("b") == [1, 2, 3, 4, 5]
    assert manager.num_free_blocks == 0
    assert_manager_integrity(manager)


def test_chunked_prefill_caches_whole_blocks_per_chunk() -> None:
    """A 100-token prompt at budget 32: 32+32+32+4, with 2, 4, 6, 6 blocks cached after each."""
    manager = make_manager(num_blocks=20, block_size=16)
    request = make_request("a", range(100), block_size=16)
    cached, allocated = [], []
    for chunk in (32, 32, 32, 4):
        if request.num_computed_tokens == 0:
            admit(manager, request, chunk)
        else:
            assert manager.allocate_slots(request, chunk) is not None
            request.num_computed_tokens += chunk
        cached.append(len(manager.block_pool.cached_block_hash_to_block))
        allocated.append(len(manager.get_block_ids("a")))
    assert cached == [2, 4, 6, 6]
    assert allocated == [2, 4, 6, 7]
    stored = manager.take_events()
    assert [len(e.block_hashes) for e in stored if isinstance(e, BlockStored)] == [2, 2, 2]
    assert_manager_integrity(manager)


def test_prompt_logprobs_request_never_reads_the_cache() -> None:
    """A request that skips reading the cache gets 0 hits, and still writes its blocks."""
    manager = make_manager(num_blocks=11)
    first = make_request("a", range(9))
    admit(manager, first)
    manager.free(first)
    second = make_request("b", range(9))
    second.skip_reading_prefix_cache = True
    assert admit(manager, second) == 0
    assert manager.get_block_ids("b") == [3, 4, 5]  # block 3 was the first's unhashed tail
    h0 = second.block_hashes[0]
    copies = [
        b.block_id for h, b in manager.block_pool.cached_block_hash_to_block.items() if h == h0
    ]
    assert sorted(copies) == [1, 3]
    assert_manager_integrity(manager)


def test_prefix_cache_stats_keep_preemption_apart() -> None:
    """queries count every token of admitted requests; re-hits after preemption are apart."""
    manager = make_manager(num_blocks=20, block_size=16)
    first = make_request("a", range(33), block_size=16)
    admit(manager, first)
    second = make_request("b", range(33), block_size=16)
    admit(manager, second)
    assert manager.prefix_cache_stats == PrefixCacheStats(requests=2, queries=66, hits=32)
    # Preempt the second request (recompute): free, reset computed tokens, re-admit.
    manager.free(second)
    second.num_computed_tokens = 0
    second.num_preemptions += 1
    admit(manager, second)
    assert manager.prefix_cache_stats == PrefixCacheStats(
        requests=2,
        queries=66,
        hits=32,
        preempted_requests=1,
        preempted_queries=33,
        preempted_hits=32,
    )
    assert manager.prefix_cache_stats.hit_rate == pytest.approx(32 / 66)
    assert_manager_integrity(manager)


def test_failed_allocation_records_no_stats() -> None:
    """A request that does not fit is not admitted, so it adds no queries."""
    manager = make_manager(num_blocks=3)
    request = make_request("a", range(12))
    assert admit(manager, request) is None
    assert manager.prefix_cache_stats == PrefixCacheStats()
    assert manager.req_to_blocks == {}


def test_no_caching_means_no_hits_no_hashes() -> None:
    """With prefix caching off nothing is registered, looked up or counted."""
    manager = make_manager(num_blocks=11, caching=False)
    first = make_request("a", range(9))
    admit(manager, first)
    manager.free(first)
    # Unhashed blocks go to the head on free, the request's tail first.
    assert manager.block_pool.free_block_queue.block_ids() == [3, 2, 1, 4, 5, 6, 7, 8, 9, 10]
    assert admit(manager, make_request("b", range(9))) == 0
    assert manager.get_block_ids("b") == [3, 2, 1]
    assert len(manager.block_pool.cached_block_hash_to_block) == 0
    assert manager.take_events() == []
    assert manager.prefix_cache_stats == PrefixCacheStats()


def test_decode_tokens_complete_and_cache_blocks() -> None:
    """Output tokens that complete a block cache it, with the previous block as parent."""
    manager = make_manager(num_blocks=11)
    request = make_request("a", range(6))
    admit(manager, request)
    (stored,) = manager.take_events()
    h0 = request.block_hashes[0]
    assert stored == BlockStored(
        block_hashes=[uint64(h0)],
        parent_block_hash=None,
        token_ids=[0, 1, 2, 3],
        block_size=4,
        lora_id=None,
        medium="GPU",
        lora_name=None,
        extra_keys=[None],
    )
    for token in (100, 101):
        request.append_output_token_ids(token)
        assert manager.allocate_slots(request, 1) == []  # block 1 still has room
        request.num_computed_tokens += 1
    h1 = request.block_hashes[1]
    assert manager.take_events() == [
        BlockStored(
            block_hashes=[uint64(h1)],
            parent_block_hash=uint64(h0),
            token_ids=[4, 5, 100, 101],
            block_size=4,
            lora_id=None,
            medium="GPU",
            lora_name=None,
            extra_keys=[None],
        )
    ]
    request.append_output_token_ids(102)
    new_blocks = manager.allocate_slots(request, 1)
    assert new_blocks is not None and [b.block_id for b in new_blocks] == [3]
    assert_manager_integrity(manager)


def test_identical_requests_store_once() -> None:
    """Two identical 33-token requests: one BlockStored with 2 hashes, none for the second."""
    manager = make_manager(num_blocks=20, block_size=16)
    first = make_request("a", range(33), block_size=16)
    admit(manager, first)
    assert manager.take_events() == [
        BlockStored(
            block_hashes=[uint64(h) for h in first.block_hashes],
            parent_block_hash=None,
            token_ids=list(range(32)),
            block_size=16,
            lora_id=None,
            medium="GPU",
            lora_name=None,
            extra_keys=[None, None],
        )
    ]
    admit(manager, make_request("b", range(33), block_size=16))
    assert manager.take_events() == []


def test_zero_token_allocation_is_rejected() -> None:
    """Allocating zero tokens raises InvalidRequestError and changes nothing."""
    manager = make_manager(num_blocks=11)
    request = make_request("a", range(5))
    before = snapshot(manager)
    with pytest.raises(InvalidRequestError, match="num_new_tokens must be positive"):
        manager.allocate_slots(request, 0)
    assert snapshot(manager) == before


def test_hits_after_first_allocation_are_rejected() -> None:
    """Prefix hits apply only to a request's first allocation."""
    manager = make_manager(num_blocks=11)
    request = make_request("a", range(9))
    admit(manager, request)
    other_blocks = manager.req_to_blocks["a"][:1]
    before = snapshot(manager)
    with pytest.raises(InvalidRequestError, match="first allocation"):
        manager.allocate_slots(request, 1, 4, other_blocks)
    assert snapshot(manager) == before


def test_free_without_blocks_is_a_no_op() -> None:
    """Freeing a request that holds no blocks (an early abort) changes nothing."""
    manager = make_manager(num_blocks=11)
    before = snapshot(manager)
    request = make_request("never-admitted", range(9))
    manager.free(request)
    manager.free(request)
    assert snapshot(manager) == before
    admit(manager, request)
    manager.free(request)
    manager.free(request)
    assert manager.get_block_ids("never-admitted") == []
    assert_manager_integrity(manager)
