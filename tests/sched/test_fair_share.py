"""One request's samples hold at most their share of the sequence slots while another request
waits (sched/fair_share.py): passed over at admission, preempted when every slot is taken."""

from __future__ import annotations

from blockserve.config import SchedulerConfig
from blockserve.core.events import KVEventRecorder
from blockserve.core.kv_cache_manager import KVCacheManager
from blockserve.sched.request import Request, RequestStatus
from blockserve.sched.scheduler import Scheduler
from tests.sched.test_scheduler import make_request, step


def make_scheduler(share: float) -> Scheduler:
    """4 slots; a share of 0.5 caps one group at 2 of them while another waits."""
    manager = KVCacheManager(40, 16, True, KVEventRecorder())
    config = SchedulerConfig(4, 2048, max_model_len=1024, max_request_seq_share=share)
    return Scheduler(config, manager, eos_token_ids=(2,))


def sample(group: str, index: int, first_token: int = 100) -> Request:
    request = make_request(f"{group}{index}", 5, first_token=first_token)
    request.group_id = group
    return request


def test_a_group_alone_takes_every_slot_then_gives_one_to_a_newcomer() -> None:
    """n=4 alone runs 4 samples; when b arrives the newest sample (a3) is preempted and b
    admitted in the same step; a3 waits until a's share or a free slot lets it back."""
    scheduler = make_scheduler(0.5)
    for index in range(4):
        scheduler.add_request(sample("a", index))
    _, scheduled = step(scheduler)
    assert sorted(scheduled) == ["a0", "a1", "a2", "a3"]
    scheduler.add_request(sample("b", 0, first_token=300))
    _, scheduled = step(scheduler)
    assert sorted(scheduled) == ["a0", "a1", "a2", "b0"]
    assert scheduler.requests["a3"].status == RequestStatus.PREEMPTED
    assert scheduler.num_preemptions == 1


def test_a_group_over_its_share_is_passed_over_at_admission() -> None:
    """a's 4 samples queue before b's: a takes its 2, then b0 and b1 pass a2 and a3."""
    scheduler = make_scheduler(0.5)
    for index in range(4):
        scheduler.add_request(sample("a", index))
    for index in range(2):
        scheduler.add_request(sample("b", index, first_token=300))
    _, scheduled = step(scheduler)
    assert sorted(scheduled) == ["a0", "a1", "b0", "b1"]
    assert [r.request_id for r in scheduler.waiting] == ["a2", "a3"]
    assert scheduler.num_preemptions == 0


def test_share_one_is_first_come_first_served() -> None:
    """With share 1 the first group keeps every slot and the newcomer waits."""
    scheduler = make_scheduler(1.0)
    for index in range(4):
        scheduler.add_request(sample("a", index))
    step(scheduler)
    scheduler.add_request(sample("b", 0, first_token=300))
    _, scheduled = step(scheduler)
    assert sorted(scheduled) == ["a0", "a1", "a2", "a3"]
    assert [r.request_id for r in scheduler.waiting] == ["b0"]
