"""The scheduler under async scheduling, without a model: step N+1 is scheduled before step
N's tokens are applied; the tokens in flight go out as placeholders, a request certain to end
on its token in flight is not scheduled again, and a token past a request's end is dropped."""

from __future__ import annotations

import pytest

from blockserve.config import SchedulerConfig
from blockserve.core.events import KVEventRecorder
from blockserve.core.kv_cache_manager import KVCacheManager
from blockserve.sched.output import PLACEHOLDER_TOKEN, ModelRunnerOutput, SchedulerOutput
from blockserve.sched.request import RequestStatus
from blockserve.sched.scheduler import Scheduler
from tests.core.helpers import assert_manager_integrity
from tests.sched.test_scheduler import EOS, make_request


def make_async_scheduler(num_blocks: int = 40) -> Scheduler:
    manager = KVCacheManager(num_blocks, 16, True, KVEventRecorder())
    config = SchedulerConfig(4, 2048, max_model_len=1024, async_scheduling=True)
    return Scheduler(config, manager, eos_token_ids=(EOS,))


def sampled(output: SchedulerOutput, token: int) -> ModelRunnerOutput:
    return ModelRunnerOutput({s.request_id: token for s in output.scheduled if s.sample})


def test_the_next_step_decodes_the_token_in_flight() -> None:
    scheduler = make_async_scheduler()
    request = make_request("a", 20, max_tokens=10)
    scheduler.add_request(request)
    first = scheduler.schedule()  # the prompt; its first token is sampled in flight
    assert [(s.token_ids[-1], s.sample) for s in first.scheduled] == [(119, True)]
    assert request.num_output_placeholders == 1
    second = scheduler.schedule()  # before the first's token is known
    assert [(s.token_ids, s.num_computed_tokens, s.sample) for s in second.scheduled] == [
        ((PLACEHOLDER_TOKEN,), 20, True)
    ]
    assert request.num_output_placeholders == 2
    scheduler.update_from_output(first, sampled(first, 7))
    assert request.output_token_ids == [7] and request.num_output_placeholders == 1
    third = scheduler.schedule()  # the engine schedules once per step applied
    assert [(s.token_ids, s.num_computed_tokens) for s in third.scheduled] == [
        ((PLACEHOLDER_TOKEN,), 21)
    ]
    scheduler.update_from_output(second, sampled(second, 8))
    scheduler.update_from_output(third, sampled(third, 9))
    assert request.output_token_ids == [7, 8, 9] and request.num_output_placeholders == 0
    fourth = scheduler.schedule()
    assert [(s.token_ids, s.num_computed_tokens) for s in fourth.scheduled] == [((9,), 22)]
    assert_manager_integrity(scheduler.kv_cache_manager)


def test_a_request_ending_on_its_token_in_flight_is_not_scheduled_again() -> None:
    scheduler = make_async_scheduler()
    scheduler.add_request(make_request("a", 20, max_tokens=1))
    scheduler.add_request(make_request("b", 20, max_tokens=5, first_token=300))
    first = scheduler.schedule()
    second = scheduler.schedule()
    assert [s.request_id for s in second.scheduled] == ["b"]  # a's one token is in flight
    scheduler.update_from_output(first, sampled(first, 7))
    assert "a" not in scheduler.requests  # finished: max_tokens
    scheduler.update_from_output(second, sampled(second, 8))
    assert scheduler.requests["b"].output_token_ids == [7, 8]


def test_a_token_past_the_end_is_dropped() -> None:
    """EOS in flight cannot be foreseen: the step after it was scheduled, and its token for
    the finished request is dropped."""
    scheduler = make_async_scheduler()
    request = make_request("a", 20, max_tokens=10)
    scheduler.add_request(request)
    first = scheduler.schedule()
    second = scheduler.schedule()
    updates = scheduler.update_from_output(first, sampled(first, EOS))
    assert [(u.request_id, u.status) for u in updates] == [("a", RequestStatus.FINISHED_STOPPED)]
    assert scheduler.update_from_output(second, sampled(second, 9)) == []
    assert request.output_token_ids == [EOS]
    assert scheduler.kv_cache_manager.usage == 0.0
    assert_manager_integrity(scheduler.kv_cache_manager)


@pytest.mark.parametrize("b_token", [8, EOS])
def test_a_preempted_request_keeps_its_token_in_flight(b_token: int) -> None:
    """Preempted while its token is in flight: the token is appended when its step's output
    comes, the request waiting; a request that token stops leaves the waiting queue."""
    scheduler = make_async_scheduler(num_blocks=4)  # 3 usable blocks
    a, b = make_request("a", 16), make_request("b", 16, first_token=300)
    scheduler.add_request(a)
    scheduler.add_request(b)
    first = scheduler.schedule()  # both prompts, one block each
    second = scheduler.schedule()  # a takes the last block; b finds none: preempted
    assert [s.request_id for s in second.scheduled] == ["a"]
    assert b.status == RequestStatus.PREEMPTED and b.num_output_placeholders == 1
    scheduler.update_from_output(first, ModelRunnerOutput({"a": 7, "b": b_token}))
    assert a.output_token_ids == [7] and b.output_token_ids == [b_token]
    assert b.num_output_placeholders == 0
    if b_token == EOS:
        assert "b" not in scheduler.requests and list(scheduler.waiting) == []
    else:
        assert list(scheduler.waiting) == [b] and b.num_computed_tokens == 0
    assert_manager_integrity(scheduler.kv_cache_manager)
