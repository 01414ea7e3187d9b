"""Admission from a lower KV tier, without a model: a request whose prefix continues below the
device waits LOADING, takes no budget, and runs from the first block not loaded."""

from __future__ import annotations

from collections.abc import Sequence

from blockserve.config import SchedulerConfig
from blockserve.core.cache_types import RequestId
from blockserve.core.events import KVEventRecorder
from blockserve.core.hashing import BlockHash
from blockserve.core.kv_cache_manager import KVCacheManager
from blockserve.sched.request import RequestStatus
from blockserve.sched.scheduler import Scheduler
from tests.core.helpers import assert_manager_integrity
from tests.sched.test_scheduler import make_request, step


class FakeTiers:
    """Tiers that hold a set of hashes; each load finishes when the test says so."""

    def __init__(self, held: dict[BlockHash, str]) -> None:
        self.held = held
        self.started: dict[RequestId, tuple[list[BlockHash], list[int]]] = {}
        self.finished: dict[RequestId, int] = {}
        self.cancelled: list[RequestId] = []

    def lookup(self, block_hashes: Sequence[BlockHash]) -> list[str]:
        found = []
        for block_hash in block_hashes:
            if block_hash not in self.held:
                break
            found.append(self.held[block_hash])
        return found

    def start_load(
        self, request_id: RequestId, block_hashes: Sequence[BlockHash], block_ids: Sequence[int]
    ) -> None:
        self.started[request_id] = (list(block_hashes), list(block_ids))

    def finished_loads(self) -> dict[RequestId, int]:
        finished, self.finished = self.finished, {}
        return finished

    def cancel_load(self, request_id: RequestId) -> None:
        self.cancelled.append(request_id)


def make(held: dict[BlockHash, str], num_blocks: int = 40, max_num_seqs: int = 16) -> Scheduler:
    manager = KVCacheManager(num_blocks, 16, True, KVEventRecorder())
    config = SchedulerConfig(max_num_seqs, 2048, max_model_len=1024)
    return Scheduler(config, manager, eos_token_ids=(2,), tiers=FakeTiers(held))


def tiers_of(scheduler: Scheduler) -> FakeTiers:
    assert scheduler.loads is not None
    tiers = scheduler.loads.tiers
    assert isinstance(tiers, FakeTiers)
    return tiers


def test_a_tier_hit_loads_then_runs_from_the_first_block_not_loaded() -> None:
    """70 tokens whose 4 full blocks sit on disk: admitted LOADING into 4 fresh blocks while a
    neighbour runs; once loaded, 64 tokens are cached and 6 computed, and the loaded blocks are
    ordinary cached blocks a later request hits on the device."""
    probe = make_request("probe", 70)
    held = dict.fromkeys(probe.block_hashes, "disk")
    scheduler = make(held)
    scheduler.add_request(make_request("a", 70))
    scheduler.add_request(make_request("other", 20, first_token=900))
    _, scheduled = step(scheduler)
    assert scheduled == {"other": 20}
    request = scheduler.requests["a"]
    assert (request.status, scheduler.num_loading) == (RequestStatus.LOADING, 1)
    hashes, block_ids = tiers_of(scheduler).started["a"]
    assert hashes == probe.block_hashes[:4] and len(block_ids) == 4
    assert scheduler.kv_cache_manager.get_block_ids("a") == block_ids
    _, scheduled = step(scheduler)  # still loading: only the neighbour decodes
    assert scheduled == {"other": 1}
    tiers_of(scheduler).finished["a"] = 4
    output, scheduled = step(scheduler)
    (new,) = [s for s in output.scheduled if s.request_id == "a"]
    assert (scheduled["a"], new.num_computed_tokens, new.new_request is not None) == (6, 64, True)
    assert (request.num_cached_tokens, request.tier_cached_tokens) == (64, {"disk": 64})
    stats = scheduler.kv_cache_manager.prefix_cache_stats
    assert (stats.queries, stats.hits) == (90, 64)
    scheduler.add_request(make_request("b", 70))
    output, _ = step(scheduler)
    (again,) = [s for s in output.scheduled if s.request_id == "b"]
    assert again.num_computed_tokens == 64  # from the device now, no load
    assert "b" not in tiers_of(scheduler).started


def test_a_failed_load_computes_the_blocks_it_missed() -> None:
    """Two of four blocks arrive: 32 tokens cached, 38 computed in the blocks already held."""
    probe = make_request("probe", 70)
    scheduler = make(dict.fromkeys(probe.block_hashes, "host"))
    scheduler.add_request(make_request("a", 70))
    step(scheduler)
    _, block_ids = tiers_of(scheduler).started["a"]
    tiers_of(scheduler).finished["a"] = 2
    output, scheduled = step(scheduler)
    assert (scheduled, output.scheduled[0].num_computed_tokens) == ({"a": 38}, 32)
    assert list(output.scheduled[0].block_ids[:4]) == block_ids
    request = scheduler.requests["a"]
    assert (request.num_cached_tokens, request.tier_cached_tokens) == (32, {"host": 32})


def test_device_hits_come_first_and_the_load_continues_after_them() -> None:
    """Blocks 0-1 on the device, 2-3 on disk: two blocks are loaded, after the device's."""
    scheduler = make({})
    scheduler.add_request(make_request("warm", 40))  # caches blocks 0 and 1 on the device
    step(scheduler)
    probe = make_request("probe", 70)
    tiers_of(scheduler).held.update(dict.fromkeys(probe.block_hashes[2:], "disk"))
    scheduler.add_request(make_request("a", 70))
    step(scheduler)
    hashes, _ = tiers_of(scheduler).started["a"]
    assert hashes == probe.block_hashes[2:4]
    assert scheduler.requests["a"].num_computed_tokens == 32
    tiers_of(scheduler).finished["a"] = 2
    output, _ = step(scheduler)
    (new,) = [s for s in output.scheduled if s.request_id == "a"]
    assert new.num_computed_tokens == 64
    assert scheduler.requests["a"].tier_cached_tokens == {"disk": 32}


def test_an_abort_while_loading_cancels_the_load_and_frees_every_block() -> None:
    probe = make_request("probe", 70)
    scheduler = make(dict.fromkeys(probe.block_hashes, "disk"))
    scheduler.add_request(make_request("a", 70))
    step(scheduler)
    scheduler.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    assert tiers_of(scheduler).cancelled == ["a"]
    manager = scheduler.kv_cache_manager
    assert (scheduler.num_loading, manager.num_free_blocks, len(manager.req_to_blocks)) == (
        0,
        39,
        0,
    )
    # The unloaded blocks were never cached: a finished load reported late is ignored.
    tiers_of(scheduler).finished["a"] = 4
    output, _ = step(scheduler)
    assert output.scheduled == () and len(manager.block_pool.cached_block_hash_to_block) == 0
    assert_manager_integrity(manager)


def test_loading_requests_count_against_max_num_seqs_and_wait_for_room() -> None:
    """max_num_seqs 1: a second request waits while the first loads; and a load that does not
    fit the free blocks waits at the head of the queue."""
    probe = make_request("probe", 70)
    scheduler = make(dict.fromkeys(probe.block_hashes, "disk"), max_num_seqs=1)
    scheduler.add_request(make_request("a", 70))
    scheduler.add_request(make_request("b", 5, first_token=900))
    _, scheduled = step(scheduler)
    assert (scheduled, scheduler.num_waiting, scheduler.num_loading) == ({}, 1, 1)
    small = make(dict.fromkeys(probe.block_hashes, "disk"), num_blocks=4)
    small.add_request(make_request("a", 70))
    _, scheduled = step(small)
    assert (scheduled, small.num_waiting, tiers_of(small).started) == ({}, 1, {})
