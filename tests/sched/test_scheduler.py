"""The scheduler without a model: exact tokens per request per step (docs/behaviour.md §2, §4)."""

from __future__ import annotations

import pytest

from blockserve.config import SchedulerConfig
from blockserve.core.events import BlockStored, KVEventRecorder
from blockserve.core.hashing import BlockHasher, RequestBlockHasher
from blockserve.core.kv_cache_manager import KVCacheManager
from blockserve.sampling_params import SamplingParams
from blockserve.sched.output import ModelRunnerOutput, SchedulerOutput
from blockserve.sched.request import Request, RequestStatus
from blockserve.sched.scheduler import Scheduler
from tests.core.helpers import assert_manager_integrity

EOS = 2
HASHER = RequestBlockHasher(BlockHasher("sha256"), 16)


def make_scheduler(
    num_blocks: int = 40,
    budget: int = 2048,
    max_num_seqs: int = 16,
    policy: str = "fcfs",
    caching: bool = True,
) -> Scheduler:
    manager = KVCacheManager(num_blocks, 16, caching, KVEventRecorder())
    config = SchedulerConfig(max_num_seqs, budget, max_model_len=1024, scheduling_policy=policy)
    return Scheduler(config, manager, eos_token_ids=(EOS,))


def make_request(
    request_id: str,
    num_tokens: int,
    max_tokens: int = 100,
    priority: int = 0,
    first_token: int = 100,
    **params: object,
) -> Request:
    """Prompt tokens first_token, first_token + 1, ...: equal first_tokens share prefixes."""
    sampling = SamplingParams(max_tokens=max_tokens, **params)  # type: ignore[arg-type]
    tokens = [first_token + i for i in range(num_tokens)]
    return Request(request_id, tokens, sampling, HASHER, priority=priority)


def step(scheduler: Scheduler, token: int = 7) -> tuple[SchedulerOutput, dict[str, int]]:
    """One step with a fake runner that samples `token` for every request that samples."""
    output = scheduler.schedule()
    sampled = {s.request_id: token for s in output.scheduled if s.sample}
    scheduler.update_from_output(output, ModelRunnerOutput(sampled))
    assert_manager_integrity(scheduler.kv_cache_manager)
    return output, {s.request_id: s.num_scheduled_tokens for s in output.scheduled}


def test_chunked_prefill_32_32_32_4() -> None:
    """Budget 32: a 100-token prompt is scheduled 32+32+32+4; the last chunk samples."""
    scheduler = make_scheduler(budget=32)
    scheduler.add_request(make_request("a", 100))
    chunks, samples = [], []
    for _ in range(4):
        output, counts = step(scheduler)
        chunks.append(counts["a"])
        samples.append(output.scheduled[0].sample)
    assert chunks == [32, 32, 32, 4]
    assert samples == [False, False, False, True]
    _, counts = step(scheduler)
    assert counts == {"a": 1}  # decoding


def test_a_scored_prompt_goes_in_short_chunks_beside_a_newcomer() -> None:
    """A 600-token prompt with prompt logprobs takes 256 + 256 + 88 (the scored-token bound
    of a step), not the whole budget; a prompt that arrives meanwhile is admitted at once
    with the budget left, and after scoring the request decodes as any other."""
    scheduler = make_scheduler(num_blocks=80, budget=2048)
    scheduler.add_request(make_request("scored", 600, prompt_logprobs=1))
    _, first = step(scheduler)
    scheduler.add_request(make_request("plain", 300, first_token=5000))
    _, second = step(scheduler)
    _, third = step(scheduler)
    _, fourth = step(scheduler)
    assert [first, second, third, fourth] == [
        {"scored": 256},
        {"scored": 256, "plain": 300},
        {"scored": 88, "plain": 1},
        {"scored": 1, "plain": 1},
    ]


def test_same_step_sharing() -> None:
    """Two identical 48-token prompts in one step: 48 + 16 tokens scheduled (32 hit)."""
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", 48))
    scheduler.add_request(make_request("b", 48))
    output, counts = step(scheduler)
    assert counts == {"a": 48, "b": 16}
    by_id = {s.request_id: s for s in output.scheduled}
    assert by_id["b"].num_computed_tokens == 32
    assert by_id["b"].block_ids[:2] == by_id["a"].block_ids[:2]
    assert scheduler.requests["b"].num_cached_tokens == 32


def test_preemption_frees_then_resume_rehits_own_blocks() -> None:
    """A tiny pool: the newest request is preempted, requeued first, and re-hits its blocks."""
    scheduler = make_scheduler(num_blocks=7)  # 6 usable blocks of 16
    scheduler.add_request(make_request("a", 47))  # 3 blocks
    scheduler.add_request(make_request("b", 47))  # the same prompt: shares 2 of them
    _, counts = step(scheduler)
    assert counts == {"a": 47, "b": 15}  # b hits a's 2 full blocks (32 tokens)
    # Decodes grow a and b into new blocks until the pool runs dry.
    preempted_at = None
    for i in range(20):
        output, counts = step(scheduler)
        if scheduler.num_preemptions:
            preempted_at = i
            break
    assert preempted_at is not None
    assert [r.request_id for r in scheduler.running] == ["a"]
    assert [r.request_id for r in scheduler.waiting] == ["b"]
    b = scheduler.requests["b"]
    assert (b.status, b.num_computed_tokens, b.num_preemptions) == (RequestStatus.PREEMPTED, 0, 1)
    assert counts == {"a": 1}  # no admission in the step that preempted
    # Finish a; b resumes and re-hits its own cached blocks (all but its last token).
    scheduler.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    output, counts = step(scheduler)
    resumed = output.scheduled[0]
    assert resumed.request_id == "b"
    assert resumed.num_computed_tokens == (b.num_tokens - 1) // 16 * 16
    stats = scheduler.kv_cache_manager.prefix_cache_stats
    assert stats.preempted_requests == 1 and stats.preempted_hits == resumed.num_computed_tokens


def test_priority_order_and_victim() -> None:
    """Waiting requests are admitted by (priority, arrival); the victim is the largest key."""
    scheduler = make_scheduler(num_blocks=6, max_num_seqs=2, policy="priority")
    low = make_request("low", 30, priority=5, first_token=1000)
    high = make_request("high", 30, priority=1, first_token=2000)
    mid = make_request("mid", 20, priority=3, first_token=3000)
    for request in (low, high, mid):
        scheduler.add_request(request)
    _, counts = step(scheduler)
    assert counts == {"high": 30, "mid": 20}  # max_num_seqs=2; low waits
    # Pool: high holds 2 blocks, mid 2 (one spare). Decoding exhausts it; mid is the victim.
    num_steps = 0
    while not scheduler.num_preemptions and num_steps < 20:
        step(scheduler)
        num_steps += 1
    # high takes the spare block for position 32 at decode step 3 (30 + 3 - 1); mid needs a
    # block for position 32 at step 13 (20 + 13 - 1), finds none, and is preempted.
    assert (num_steps, scheduler.num_preemptions) == (13, 1)
    assert [r.request_id for r in scheduler.running] == ["high"]
    assert [r.request_id for r in scheduler.waiting] == ["mid", "low"]


def test_waiting_high_priority_does_not_preempt() -> None:
    """A high-priority arrival jumps the queue but never preempts a running request."""
    scheduler = make_scheduler(max_num_seqs=1, policy="priority")
    scheduler.add_request(make_request("first", 10, priority=5))
    step(scheduler)
    scheduler.add_request(make_request("urgent", 10, priority=0))
    _, counts = step(scheduler)
    assert counts == {"first": 1}
    assert [r.request_id for r in scheduler.waiting] == ["urgent"]


def admission_order(policy: str, num_blocks: int) -> tuple[list[str], int]:
    """Interleaved groups a, b, c of 48-token prompts, one request per step, one output token:
    the order requests are admitted in and the tokens they computed."""
    scheduler = make_scheduler(num_blocks=num_blocks, max_num_seqs=1, policy=policy)
    for index in range(2):
        for group, first_token in (("a", 1000), ("b", 2000), ("c", 3000)):
            scheduler.add_request(make_request(f"{group}{index}", 48, 1, first_token=first_token))
    order, num_computed = [], 0
    for _ in range(12):
        output, counts = step(scheduler)
        order += [s.request_id for s in output.scheduled if s.new_request is not None]
        num_computed += sum(counts.values())
    assert not scheduler.has_unfinished_requests()
    return order, num_computed


def test_lpm_runs_a_prefix_group_together() -> None:
    """With room for one group's blocks, fcfs recomputes every prompt (each group's prefix is
    evicted before its second request comes round); lpm admits a0 then a1 (which now matches
    2 blocks) and saves 32 tokens per group."""
    assert admission_order("fcfs", num_blocks=5) == (["a0", "b0", "c0", "a1", "b1", "c1"], 288)
    lpm = admission_order("lpm", num_blocks=5)
    assert lpm == (["a0", "a1", "b0", "b1", "c0", "c1"], 288 - 3 * 32)


def test_strict_head_of_line() -> None:
    """A waiting request that does not fit blocks those behind it, even if they would fit."""
    scheduler = make_scheduler(num_blocks=6)  # 5 usable blocks
    scheduler.add_request(make_request("x", 17, max_tokens=1))  # leaves block 1 cached, free
    step(scheduler)
    scheduler.add_request(make_request("a", 56, first_token=5000))  # takes the 4 other blocks
    step(scheduler)
    assert scheduler.kv_cache_manager.num_free_blocks == 1
    # "head" hits the free cached block, so it needs that block plus a new one: 2 > 1 free.
    scheduler.add_request(make_request("head", 30))
    scheduler.add_request(make_request("small", 5, first_token=9000))  # 1 block would fit
    _, counts = step(scheduler)
    assert counts == {"a": 1}
    assert [r.request_id for r in scheduler.waiting] == ["head", "small"]


def test_abort_frees_blocks_within_one_step() -> None:
    """Aborting a running request frees its blocks at once; the runner hears of it next step."""
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", 40))
    step(scheduler)
    manager = scheduler.kv_cache_manager
    assert manager.get_block_ids("a") != []
    scheduler.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    assert manager.get_block_ids("a") == []
    assert manager.usage == 0.0
    output = scheduler.schedule()
    assert output.finished_request_ids == frozenset({"a"})
    assert not scheduler.has_unfinished_requests()


def test_abort_of_waiting_request() -> None:
    """A request aborted before admission leaves the queue and holds nothing."""
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", 10))
    (request,) = scheduler.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    assert request.status == RequestStatus.FINISHED_ABORTED
    assert scheduler.num_waiting == 0
    assert scheduler.finish_requests(["a", "unknown"], RequestStatus.FINISHED_ABORTED) == []


@pytest.mark.parametrize(
    ("params", "tokens", "status", "num_outputs"),
    [
        ({}, [7, 7, EOS], RequestStatus.FINISHED_STOPPED, 3),
        ({"ignore_eos": True, "max_tokens": 4}, [EOS] * 4, RequestStatus.FINISHED_LENGTH_CAPPED, 4),
        ({"min_tokens": 3, "max_tokens": 10}, [EOS, EOS, EOS], RequestStatus.FINISHED_STOPPED, 3),
        ({"stop_token_ids": (9,)}, [7, 9], RequestStatus.FINISHED_STOPPED, 2),
        ({"max_tokens": 2}, [7, 7], RequestStatus.FINISHED_LENGTH_CAPPED, 2),
    ],
)
def test_stop_conditions(
    params: dict[str, object], tokens: list[int], status: RequestStatus, num_outputs: int
) -> None:
    """EOS (unless ignored, not before min_tokens), stop token ids and max_tokens end requests."""
    scheduler = make_scheduler()
    request = make_request("a", 5, **params)  # type: ignore[arg-type]
    scheduler.add_request(request)
    for token in tokens:
        output = scheduler.schedule()
        updates = scheduler.update_from_output(output, ModelRunnerOutput({"a": token}))
    assert updates[-1].status == status
    assert request.status == status and request.num_output_tokens == num_outputs
    assert scheduler.kv_cache_manager.usage == 0.0


def test_context_length_caps_generation() -> None:
    """A request stops with "length" when it reaches max_model_len."""
    scheduler = make_scheduler(num_blocks=70)
    request = make_request("a", 1020, max_tokens=100)
    scheduler.add_request(request)
    for _ in range(4):
        step(scheduler)
    assert request.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert request.num_tokens == 1024


def test_one_kv_event_batch_per_step() -> None:
    """The step's events come out as one batch with data_parallel_rank 0; none when idle."""
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", 33))
    scheduler.add_request(make_request("b", 33))
    step(scheduler)
    batch = scheduler.take_kv_event_batch()
    assert batch is not None and batch.data_parallel_rank == 0
    (stored,) = batch.events
    assert isinstance(stored, BlockStored) and len(stored.block_hashes) == 2
    assert scheduler.take_kv_event_batch() is None
