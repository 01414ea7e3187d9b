"""Eviction policies: exact hand-out orders in tiny worlds (block size 4)."""

from __future__ import annotations

import pytest

from blockserve.core.eviction import TailLRUConfig
from blockserve.core.kv_cache_manager import KVCacheManager
from blockserve.errors import InvalidConfigError
from tests.core.helpers import admit, assert_manager_integrity, make_manager, make_request


def run(manager: KVCacheManager, name: str, tokens: list[int], priority: int = 0) -> int | None:
    """Admit, then finish, one request; returns its hit tokens."""
    request = make_request(name, tokens, priority=priority)
    hits = admit(manager, request)
    manager.free(request)
    return hits


def cached_order(manager: KVCacheManager) -> list[int]:
    """The free blocks that still cache something, in the order they would be evicted."""
    pool = manager.block_pool
    return [b.block_id for b in pool.free_block_queue if b.block_hash is not None]


A, B, C = list(range(0, 9)), list(range(20, 29)), list(range(40, 49))  # 2 full blocks each


def test_lru_is_the_free_queue() -> None:
    """lru: least recently freed first, each request's deeper block before its first."""
    manager = make_manager(11, policy="lru")
    for name, tokens in (("a", A), ("b", B)):
        run(manager, name, tokens)
    # Each request's unhashed tail block goes to the head and is reused by the next one.
    assert cached_order(manager) == [2, 1, 4, 3]
    assert_manager_integrity(manager)


def test_lfu_evicts_the_least_hit_block() -> None:
    """lfu: after A is hit twice, B's blocks go first although B was freed later."""
    manager = make_manager(11, policy="lfu")
    run(manager, "a", A)
    run(manager, "a2", A)
    run(manager, "a3", A)
    run(manager, "b", B)
    # A's blocks (1, 2) have 2 hits each; B's (3, 4) none; ties keep the deeper first.
    assert cached_order(manager) == [4, 3, 2, 1]
    assert_manager_integrity(manager)


def test_slru_protects_hit_blocks() -> None:
    """slru: never-hit blocks (probation) are evicted before hit ones (protected)."""
    manager = make_manager(11, policy="slru")
    run(manager, "a", A)
    run(manager, "a2", A)  # A hit once: protected
    run(manager, "b", B)
    run(manager, "c", C)
    assert cached_order(manager) == [4, 3, 6, 5, 2, 1]
    assert_manager_integrity(manager)


def test_ghost_gives_returning_blocks_a_second_chance() -> None:
    """ghost: an evicted hash cached again enters protected; one-off blocks stay in probation."""
    manager = make_manager(6, policy="ghost")  # 5 usable blocks
    run(manager, "a", A)  # A's blocks cached (probation)
    run(manager, "b", B)  # evicts A's blocks: their hashes become ghosts
    run(manager, "a2", A)  # A returns: recomputed, cached again, now protected
    run(manager, "c", C)  # C is new: probation, so it is evicted before A
    order = cached_order(manager)
    a_blocks = manager.block_pool.cached_block_hash_to_block
    a_ids = [a_blocks.get_one_block(h).block_id for h in make_request("x", A).block_hashes]  # type: ignore[union-attr]
    assert order[-2:] == list(reversed(a_ids))
    assert run(manager, "d", list(range(60, 69))) == 0
    assert run(manager, "a3", A) == 8  # A survived the one-off traffic
    assert_manager_integrity(manager)


def block_ids(manager: KVCacheManager, tokens: list[int]) -> list[int]:
    """The ids of the blocks caching `tokens`' full blocks, in token order."""
    cached = manager.block_pool.cached_block_hash_to_block
    hashes = make_request("x", tokens).block_hashes
    return [cached.get_one_block(h).block_id for h in hashes]  # type: ignore[union-attr]


def test_priority_evicts_the_least_urgent_requests_blocks_first() -> None:
    """priority: B (priority 5, served last by the scheduler) goes before A and C (0),
    though freed between them; equal priorities keep LRU order, deeper block first."""
    manager = make_manager(11, policy="priority")
    run(manager, "a", A, priority=0)
    run(manager, "b", B, priority=5)
    run(manager, "c", C, priority=0)
    a, b, c = (block_ids(manager, t) for t in (A, B, C))
    assert cached_order(manager) == [b[1], b[0], a[1], a[0], c[1], c[0]]
    assert_manager_integrity(manager)


def test_priority_follows_the_request_that_last_let_go() -> None:
    """A's blocks, freed again by an urgent request (priority -3), now go last."""
    manager = make_manager(11, policy="priority")
    run(manager, "a", A, priority=5)
    run(manager, "b", B, priority=0)
    assert run(manager, "a2", A, priority=-3) == 8
    a, b = block_ids(manager, A), block_ids(manager, B)
    assert cached_order(manager) == [b[1], b[0], a[1], a[0]]
    assert_manager_integrity(manager)


def test_tlru_evicts_what_cannot_help_a_next_turn_first() -> None:
    """tlru with xi = 6 tokens and a next turn of 1: A (9 tokens) must keep its first
    9 + 1 - 6 = 4 tokens (block 0); its block 1 and all of D (5 tokens: 5 + 1 - 6 = 0 to
    keep) are past the budget and go first, in LRU order; A's block 0 goes last."""
    manager = make_manager(11, policy="tlru", tlru=TailLRUConfig(6, 1))
    D = list(range(60, 65))
    run(manager, "a", A)
    run(manager, "d", D)
    a, (d0,) = block_ids(manager, A), block_ids(manager, D)
    assert cached_order(manager) == [a[1], d0, a[0]]
    assert_manager_integrity(manager)


def test_tlru_with_no_budget_to_spare_is_lru() -> None:
    """A threshold of 0 tokens: every block is needed, so the order is plain LRU's."""
    manager = make_manager(11, policy="tlru", tlru=TailLRUConfig(0, 0))
    run(manager, "a", A)
    run(manager, "b", B)
    a, b = block_ids(manager, A), block_ids(manager, B)
    assert cached_order(manager) == [a[1], a[0], b[1], b[0]]


@pytest.mark.parametrize("policy", ["lru", "lfu", "slru", "ghost", "priority", "tlru"])
def test_held_blocks_are_never_evicted(policy: str) -> None:
    """Under pressure every policy evicts free blocks only; a running request keeps its own."""
    manager = make_manager(8, policy=policy)  # 7 usable blocks
    holder = make_request("holder", list(range(100, 113)))  # 4 blocks, held throughout
    admit(manager, holder)
    held = manager.get_block_ids("holder")
    for i in range(6):
        run(manager, f"r{i}", list(range(10 * i, 10 * i + 9)))
        assert manager.get_block_ids("holder") == held
        assert all(manager.block_pool.blocks[b].ref_cnt == 1 for b in held)
    assert_manager_integrity(manager)


def test_unknown_policy_is_rejected() -> None:
    """An unknown policy name is a typed configuration error."""
    with pytest.raises(InvalidConfigError, match="lru, lfu, slru, ghost, priority, tlru"):
        make_manager(8, policy="fifo")
