"""Random admit / grow / decode / preempt / free / reset sequences never break the pool."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from blockserve.core.events import AllBlocksCleared, BlockRemoved, BlockStored
from blockserve.core.eviction import TailLRUConfig
from blockserve.sched.request import Request
from tests.core.helpers import admit, assert_manager_integrity, make_manager, make_request, uint64

# A few shared openings so that requests hit each other's blocks.
PREFIXES = [list(range(10)), [*range(10), 50, 51, 52, 53], [7] * 9]


class PoolMachine(RuleBasedStateMachine):
    """Drives a KVCacheManager the way a scheduler would, in a tiny world (10 blocks of 4).

    Besides pool integrity, it mirrors the cached hashes from the emitted events, as a router
    would, and checks the mirror equals the pool's hash map after every step.
    """

    policy = "lru"
    tlru = TailLRUConfig(8, 2)  # small enough that the requests here straddle the budget

    def __init__(self) -> None:
        super().__init__()
        self.manager = make_manager(11, 4, policy=self.policy, tlru=self.tlru)
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.mirror: set[int] = set()
        self.next_id = 0

    @rule(
        prefix=st.sampled_from(PREFIXES),
        suffix=st.lists(st.integers(0, 3), max_size=8),
        priority=st.integers(-2, 2),
    )
    def add_request(self, prefix: list[int], suffix: list[int], priority: int) -> None:
        request = make_request(f"r{self.next_id}", prefix + suffix, priority=priority)
        self.waiting.append(request)
        self.next_id += 1

    @precondition(lambda self: self.waiting)
    @rule(index=st.integers(0, 100), chunk=st.integers(1, 12))
    def admit_one(self, index: int, chunk: int) -> None:
        request = self.waiting[index % len(self.waiting)]
        hit_blocks, num_hits = self.manager.get_computed_blocks(request)
        num_new = min(chunk, request.num_tokens - num_hits)
        if self.manager.allocate_slots(request, num_new, num_hits, hit_blocks) is None:
            return
        request.num_computed_tokens = num_hits + num_new
        self.waiting.remove(request)
        self.running.append(request)

    @precondition(lambda self: self.running)
    @rule(index=st.integers(0, 100), chunk=st.integers(1, 12), token=st.integers(0, 3))
    def step_one(self, index: int, chunk: int, token: int) -> None:
        """Prefill a further chunk, or decode one token; preempt the request if it won't fit."""
        request = self.running[index % len(self.running)]
        if request.num_computed_tokens == request.num_tokens:
            request.append_output_token_ids(token)
        num_new = min(chunk, request.num_tokens - request.num_computed_tokens)
        if self.manager.allocate_slots(request, num_new) is None:
            self.manager.free(request)
            request.num_computed_tokens = 0
            request.num_preemptions += 1
            self.running.remove(request)
            self.waiting.insert(0, request)
            return
        request.num_computed_tokens += num_new

    @precondition(lambda self: self.running)
    @rule(index=st.integers(0, 100))
    def finish_one(self, index: int) -> None:
        request = self.running.pop(index % len(self.running))
        self.manager.free(request)

    @rule()
    def reset(self) -> None:
        assert self.manager.reset_prefix_cache() == (not self.running)

    @invariant()
    def pool_is_consistent(self) -> None:
        assert_manager_integrity(self.manager)
        for event in self.manager.take_events():
            if isinstance(event, BlockStored):
                self.mirror.update(event.block_hashes)  # type: ignore[arg-type]
            elif isinstance(event, BlockRemoved):
                assert set(event.block_hashes) <= self.mirror  # type: ignore[arg-type]
                self.mirror.difference_update(event.block_hashes)  # type: ignore[arg-type]
            else:
                assert isinstance(event, AllBlocksCleared)
                self.mirror.clear()
        pool_hashes = {
            uint64(h) for h in self.manager.block_pool.cached_block_hash_to_block.hashes()
        }
        assert self.mirror == pool_hashes
        for request in self.running:
            assert len(self.manager.get_block_ids(request.request_id)) == -(
                -request.num_computed_tokens // 4
            )


PoolMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestPoolMachine = PoolMachine.TestCase


def _machine_for(policy: str) -> type[PoolMachine]:
    machine = type(f"PoolMachine_{policy}", (PoolMachine,), {"policy": policy})
    machine.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
    return machine


TestLFUPoolMachine = _machine_for("lfu").TestCase
TestSLRUPoolMachine = _machine_for("slru").TestCase
TestGhostPoolMachine = _machine_for("ghost").TestCase
TestPriorityPoolMachine = _machine_for("priority").TestCase
TestTailLRUPoolMachine = _machine_for("tlru").TestCase


def test_preempted_request_rehits_its_own_blocks() -> None:
    """After preemption a request's freed blocks stay cached, so re-admission hits them."""
    manager = make_manager(num_blocks=11, block_size=4)
    request = make_request("a", range(13))
    admit(manager, request)
    manager.free(request)
    request.num_computed_tokens = 0
    request.num_preemptions += 1
    assert admit(manager, request) == 12
    assert_manager_integrity(manager)
