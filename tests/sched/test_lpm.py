"""The lpm waiting queue: longest cached prefix first, aging by virtual arrival, and matches
kept current from the pool's events (equal to a full rescan after any store/evict sequence)."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from blockserve.config import SchedulerConfig
from blockserve.core.kv_cache_manager import KVCacheManager
from blockserve.sched.lpm import LpmQueue
from blockserve.sched.queues import create_request_queue
from blockserve.sched.request import Request
from tests.core.helpers import admit, assert_manager_integrity, make_manager, make_request

BLOCK_SIZE = 4
MAX_MODEL_LEN = 64  # 16 blocks: one cached block moves a request 1/16 of aging_s ahead


def make_queue(manager: KVCacheManager, aging_s: float = 16.0) -> LpmQueue:
    config = SchedulerConfig(
        max_model_len=MAX_MODEL_LEN, scheduling_policy="lpm", lpm_aging_s=aging_s
    )
    queue = create_request_queue(config, manager)
    assert isinstance(queue, LpmQueue)
    return queue


def cache(manager: KVCacheManager, request_id: str, token_ids: list[int]) -> None:
    """Compute and free a request: its full blocks stay cached (free, evictable)."""
    request = make_request(request_id, token_ids)
    assert admit(manager, request) is not None
    manager.free(request)


def waiting(request_id: str, token_ids: list[int], arrival: float = 0.0) -> Request:
    request = make_request(request_id, token_ids)
    request.arrival_time = arrival
    return request


def ids(queue: LpmQueue) -> list[object]:
    return [r.request_id for r in queue]


def test_a_burst_is_ordered_by_cached_prefix_then_by_arrival() -> None:
    """Equal arrivals: 3 cached blocks before 2 before 0; equal matches keep add order."""
    manager = make_manager(num_blocks=20)
    cache(manager, "warm", list(range(13)))  # blocks 0..2 of range() cached
    queue = make_queue(manager)
    queue.add(waiting("cold", list(range(100, 113))))
    queue.add(waiting("two", list(range(8)) + [99] * 5))
    queue.add(waiting("three", list(range(13))))
    queue.add(waiting("cold2", list(range(200, 213))))
    assert ids(queue) == ["three", "two", "cold", "cold2"]
    assert [queue.num_matched_blocks(r) for r in queue] == [3, 2, 0, 0]
    assert [queue.pop().request_id for _ in range(4)] == ["three", "two", "cold", "cold2"]


def test_the_last_token_is_never_counted_as_matched() -> None:
    """A 12-token prompt with all 3 blocks cached matches 2: its last token is recomputed."""
    manager = make_manager()
    cache(manager, "warm", list(range(12)))
    queue = make_queue(manager)
    queue.add(waiting("same", list(range(12))))
    assert queue.num_matched_blocks(queue.peek()) == 2


def test_aging_a_match_moves_a_request_ahead_by_at_most_aging_s() -> None:
    """aging_s 16, 16-block context: each cached block is worth 1 s. 3 blocks beat a request
    2.9 s older, not one 3 s older (tie: add order) or 3.1 s older."""
    for gap, expected in ((2.9, ["warm", "old"]), (3.0, ["old", "warm"]), (3.1, ["old", "warm"])):
        manager = make_manager(num_blocks=20)
        cache(manager, "seed", list(range(13)))
        queue = make_queue(manager, aging_s=16.0)
        queue.add(waiting("old", list(range(100, 113)), arrival=0.0))
        queue.add(waiting("warm", list(range(13)), arrival=gap))
        assert ids(queue) == expected, gap


def test_the_aging_bound_holds_for_the_longest_possible_match() -> None:
    """A whole context cached (15 matchable blocks) is worth 15 s < aging_s 16: a request that
    arrived 16 s later never goes first, whatever it matches."""
    manager = make_manager(num_blocks=20)
    cache(manager, "seed", list(range(64)))
    queue = make_queue(manager, aging_s=16.0)
    queue.add(waiting("old", [999] * 4, arrival=0.0))
    queue.add(waiting("full", list(range(64)), arrival=16.0))
    assert queue.num_matched_blocks(next(r for r in queue if r.request_id == "full")) == 15
    assert ids(queue) == ["old", "full"]


def test_zero_aging_is_fcfs() -> None:
    """aging_s 0: the cache moves nobody, arrival order rules."""
    manager = make_manager(num_blocks=20)
    cache(manager, "seed", list(range(13)))
    queue = make_queue(manager, aging_s=0.0)
    queue.add(waiting("cold", [999] * 13, arrival=1.0))
    queue.add(waiting("warm", list(range(13)), arrival=2.0))
    assert ids(queue) == ["cold", "warm"]


def test_stores_and_evictions_reorder_the_queue() -> None:
    """A store advances the requests it extends; evicting their blocks sends them back."""
    manager = make_manager(num_blocks=5)  # 4 usable blocks
    queue = make_queue(manager)
    queue.add(waiting("a", [999] * 9))
    queue.add(waiting("b", list(range(9))))
    assert ids(queue) == ["a", "b"]
    cache(manager, "seed", list(range(9)))  # stores b's 2 blocks
    assert (ids(queue), queue.num_matched_blocks(queue.peek())) == (["b", "a"], 2)
    cache(manager, "flood", list(range(500, 516)))  # 4 new blocks: both of b's evicted
    assert (ids(queue), [queue.num_matched_blocks(r) for r in queue]) == (["a", "b"], [0, 0])


def test_a_reset_clears_every_match() -> None:
    """reset_prefix_cache: no request matches anything, order falls back to arrival."""
    manager = make_manager()
    cache(manager, "seed", list(range(9)))
    queue = make_queue(manager)
    queue.add(waiting("a", [999] * 9))
    queue.add(waiting("b", list(range(9))))
    assert ids(queue) == ["b", "a"]
    assert manager.reset_prefix_cache()
    assert (ids(queue), [queue.num_matched_blocks(r) for r in queue]) == (["a", "b"], [0, 0])


def test_pop_takes_the_peeked_request_even_after_a_rekey() -> None:
    """Admitting the head stores its blocks, which can lift another request above it; pop()
    still removes the request peek() answered."""
    manager = make_manager(num_blocks=20)
    queue = make_queue(manager)
    head = waiting("head", list(range(9)))  # 2 matchable blocks, 2 full blocks stored
    other = waiting("other", [*range(8), 7, 7, 7, 7, 7])  # matchable: 3 blocks
    queue.add(head)
    queue.add(other)
    assert queue.peek() is head
    assert admit(manager, head) == 0  # stores blocks 0-1, shared with other
    assert [queue.num_matched_blocks(r) for r in queue] == [2, 2]
    assert queue.pop() is head
    assert ids(queue) == ["other"]


def test_preempted_requests_go_in_front_in_fcfs_order() -> None:
    """prepend puts a request ahead of every match; remove works on both parts."""
    manager = make_manager()
    cache(manager, "seed", list(range(9)))
    queue = make_queue(manager)
    queue.add(waiting("warm", list(range(9))))
    queue.prepend(waiting("p1", [5] * 9))
    queue.prepend(waiting("p2", [6] * 9))
    assert (ids(queue), len(queue)) == (["p2", "p1", "warm"], 3)
    queue.remove(next(iter(queue)))
    assert [queue.pop().request_id for _ in range(2)] == ["p1", "warm"]
    assert len(queue) == 0


def test_pop_after_the_peeked_request_was_removed() -> None:
    """An abort between peek and pop: pop takes the front's next request, then the heap's."""
    manager = make_manager()
    queue = make_queue(manager)
    queue.add(waiting("warm", list(range(9))))
    first, second = waiting("p1", [5] * 9), waiting("p2", [6] * 9)
    queue.prepend(second)
    queue.prepend(first)
    queue.remove(queue.peek())
    assert [queue.pop().request_id for _ in range(2)] == ["p2", "warm"]
    queue.add(waiting("late", [7] * 9))
    queue.remove(queue.peek())
    assert len(queue) == 0


def test_a_request_that_skips_the_cache_matches_nothing() -> None:
    """prompt_logprobs requests never read the cache, so lpm gives them no head start."""
    manager = make_manager()
    cache(manager, "seed", list(range(9)))
    queue = make_queue(manager)
    request = waiting("logprobs", list(range(9)))
    request.skip_reading_prefix_cache = True
    queue.add(request)
    assert queue.num_matched_blocks(request) == 0


FAMILIES = [list(range(base, base + 40)) for base in (0, 1000, 2000)]


class IncrementalMatchMachine(RuleBasedStateMachine):
    """Random adds, computed-and-freed requests (stores, evictions), aborts and resets: every
    waiting request's incremental match equals the manager's own lookup, and the queue's
    order equals sorting by (virtual arrival, add order)."""

    def __init__(self) -> None:
        super().__init__()
        self.manager = make_manager(num_blocks=9)  # 8 usable blocks: evictions are frequent
        self.queue = make_queue(self.manager, aging_s=4.0)
        self.added: list[Request] = []
        self.num_requests = 0

    def _request(self, family: int, length: int, arrival: float = 0.0) -> Request:
        self.num_requests += 1
        return waiting(f"r{self.num_requests}", FAMILIES[family][:length], arrival)

    @rule(
        family=st.integers(0, 2),
        length=st.integers(1, 30),
        arrival=st.sampled_from([0.0, 0.5, 1.0]),
    )
    def add(self, family: int, length: int, arrival: float) -> None:
        request = self._request(family, length, arrival)
        self.queue.add(request)
        self.added.append(request)

    @rule(family=st.integers(0, 2), length=st.integers(1, 32))
    def compute_and_free(self, family: int, length: int) -> None:
        request = self._request(family, length)
        if admit(self.manager, request) is not None:
            self.manager.free(request)

    @precondition(lambda self: len(self.queue) > 0)
    @rule(index=st.integers(0, 100))
    def remove(self, index: int) -> None:
        request = list(self.queue)[index % len(self.queue)]
        self.queue.remove(request)
        self.added.remove(request)

    @precondition(lambda self: len(self.queue) > 0)
    @rule()
    def pop(self) -> None:
        self.added.remove(self.queue.pop())

    @rule()
    def reset(self) -> None:
        assert self.manager.reset_prefix_cache()

    @invariant()
    def matches_equal_a_full_rescan(self) -> None:
        for request in self.added:
            expected = self.manager.get_computed_blocks(request).num_hit_tokens // BLOCK_SIZE
            assert self.queue.num_matched_blocks(request) == expected, request.request_id

    @invariant()
    def order_is_virtual_arrival_then_add_order(self) -> None:
        def key(request: Request) -> tuple[float, int]:
            shift = 4.0 * self.queue.num_matched_blocks(request) * BLOCK_SIZE / MAX_MODEL_LEN
            return (request.arrival_time - shift, self.added.index(request))

        assert list(self.queue) == sorted(self.added, key=key)
        if self.added:
            assert self.queue.peek() is min(self.added, key=key)
        assert_manager_integrity(self.manager)


IncrementalMatchMachine.TestCase.settings = settings(
    max_examples=120, stateful_step_count=40, deadline=None
)
TestIncrementalMatch = IncrementalMatchMachine.TestCase
