"""The encoder cache, vLLM 0.32's rules, on the manager alone and through the scheduler with a fake
runner: an image is encoded in the step that first reaches its embeddings, once for every
request that holds it; it stays after its requests end until its space is wanted (oldest
first), and the runner is told what to drop; a step stops before an image its budget or the
cache cannot take; a prefix hit past an image needs no encoder; preemption and aborts release."""

from __future__ import annotations

from blockserve.config import SchedulerConfig
from blockserve.core.events import KVEventRecorder
from blockserve.core.hashing import (
    BlockHasher,
    BlockKeyInputs,
    MultiModalFeature,
    RequestBlockHasher,
)
from blockserve.core.kv_cache_manager import KVCacheManager
from blockserve.multimodal.inputs import ImageInput
from blockserve.sampling_params import SamplingParams
from blockserve.sched.encoder_cache import EncoderCacheManager, encoder_cache_for
from blockserve.sched.output import ModelRunnerOutput, SchedulerOutput
from blockserve.sched.request import Request, RequestStatus
from blockserve.sched.scheduler import Scheduler

HASHER = RequestBlockHasher(BlockHasher("sha256"), 16)


def image(identifier: str, offset: int, length: int = 40, embeds: int = 32) -> ImageInput:
    """A span of `length` tokens at `offset`, its embeddings at 4, 5, ... (markers first)."""
    return ImageInput(identifier, offset, length, embed_positions=tuple(range(4, 4 + embeds)))


def request(
    request_id: str, images: tuple[ImageInput, ...], num_tokens: int = 80, differ_at: int = 999
) -> Request:
    """Tokens 100, 101, ... (500, 501, ... from `differ_at` on); the images keyed into its
    blocks as the engine keys them."""
    features = tuple(MultiModalFeature(i.identifier, i.offset, i.length) for i in images)
    keys = BlockKeyInputs(mm_features=features)
    tokens = [(100 if t < differ_at else 500) + t for t in range(num_tokens)]
    made = Request(request_id, tokens, SamplingParams(max_tokens=2), HASHER, hash_keys=keys)
    made.images = images
    return made


def make_scheduler(
    cache_size: int | None = None, budget: int = 2048, encoder_budget: int | None = None
) -> Scheduler:
    """Images of 32 embeddings at most; the cache and the encoder budget sized as the engine
    sizes them (`cache_size`: --encoder-cache-size), or the budget given."""
    manager = KVCacheManager(64, 16, True, KVEventRecorder())
    config = SchedulerConfig(16, budget, max_model_len=1024)
    cache, sized_budget = encoder_cache_for(32, budget, cache_size)
    return Scheduler(
        config,
        manager,
        encoder_cache=cache,
        encoder_budget=sized_budget if encoder_budget is None else encoder_budget,
    )


def step(scheduler: Scheduler) -> SchedulerOutput:
    output = scheduler.schedule()
    sampled = {s.request_id: 7 for s in output.scheduled if s.sample}
    scheduler.update_from_output(output, ModelRunnerOutput(sampled))
    return output


def run_to_end(scheduler: Scheduler, limit: int = 20) -> list[SchedulerOutput]:
    outputs = []
    for _ in range(limit):
        if not scheduler.has_unfinished_requests():
            return outputs
        outputs.append(step(scheduler))
    raise AssertionError(f"unfinished after {limit} steps")


def test_the_manager_keeps_unreferenced_entries_until_their_space_is_wanted() -> None:
    cache = EncoderCacheManager(64)
    images = (image("a", 0), image("b", 50))
    for index, item in enumerate(images):
        assert cache.can_allocate(32, budget=64, num_scheduled=0)
        cache.allocate("r", index, item.identifier, 32)
    assert (cache.num_free, cache.num_freeable) == (0, 0)
    cache.release("r", 0, images)
    cache.release("r", 1, images)
    assert (cache.num_free, cache.num_freeable, len(cache)) == (0, 64, 2)
    assert cache.reference("s", 0, "b")  # b is wanted again: no longer freeable
    assert not cache.can_allocate(33, budget=64, num_scheduled=0)  # more than a's room
    assert cache.can_allocate(32, budget=64, num_scheduled=0)  # evicts a, the oldest
    assert "a" not in cache and "b" in cache
    assert cache.take_freed() == ("a",) and cache.take_freed() == ()
    assert not cache.can_allocate(33, budget=32, num_scheduled=0)  # over the step's budget


def test_with_the_cache_off_an_entry_goes_when_unreferenced() -> None:
    cache, budget = encoder_cache_for(32, 2048, 0)
    assert (cache.cache_size, budget) == (32, 2048)
    images = (image("a", 0),)
    cache.allocate("r", 0, "a", 32)
    cache.release("r", 0, images)
    assert len(cache) == 0 and cache.take_freed() == ("a",)


def test_an_image_is_encoded_once_where_its_embeddings_begin() -> None:
    """Budget 16: the image (span 20..59, embeddings 24..55) is encoded in the step that
    reaches position 24, not in the one that reaches only its markers (16..19 is text, 20..23
    markers); a second request with the same image, later, is never encoded."""
    scheduler = make_scheduler(budget=16, encoder_budget=64)
    scheduler.add_request(request("a", (image("cat", 20),)))
    encoded = [
        (out.encoder_inputs, out.scheduled[0].num_computed_tokens) for out in run_to_end(scheduler)
    ]
    assert [at for inputs, at in encoded if inputs] == [16]
    assert encoded[1][0] == (("a", 0),)
    scheduler.add_request(request("b", (image("cat", 20),), num_tokens=81))  # no prefix hit past 80
    scheduler.kv_cache_manager.reset_prefix_cache()
    assert all(not out.encoder_inputs for out in run_to_end(scheduler))


def test_two_requests_with_one_image_in_one_step_encode_it_once() -> None:
    scheduler = make_scheduler()
    scheduler.add_request(request("a", (image("cat", 8),), num_tokens=70))
    scheduler.add_request(request("b", (image("cat", 8),), num_tokens=75))
    first = step(scheduler)
    assert first.encoder_inputs == (("a", 0),)
    assert {s.request_id for s in first.scheduled} == {"a", "b"}


def test_a_step_stops_before_an_image_its_encoder_budget_cannot_take() -> None:
    """Encoder budget 32: a's image takes it; b's image (at 30) waits for the next step, b
    computing its 30 tokens of text before it meanwhile."""
    scheduler = make_scheduler(encoder_budget=32)
    scheduler.add_request(request("a", (image("cat", 8),)))
    scheduler.add_request(request("b", (image("dog", 30),)))
    first = step(scheduler)
    assert first.encoder_inputs == (("a", 0),)
    assert {s.request_id: s.num_scheduled_tokens for s in first.scheduled} == {"a": 80, "b": 30}
    second = step(scheduler)
    assert second.encoder_inputs == (("b", 0),)


def test_a_full_cache_evicts_the_oldest_unneeded_image_and_tells_the_runner() -> None:
    """A cache of one image: cat is held after a ends; dog evicts it, and that step's output
    names cat for the runner to drop."""
    scheduler = make_scheduler(cache_size=32)
    scheduler.add_request(request("a", (image("cat", 8),)))
    run_to_end(scheduler)
    assert "cat" in scheduler.encoder_cache
    scheduler.add_request(request("b", (image("dog", 8),)))
    first = step(scheduler)
    assert first.encoder_inputs == (("b", 0),) and first.freed_encoder_ids == ("cat",)


def test_a_prefix_hit_past_the_image_needs_no_encoder() -> None:
    """a computes its prompt (image at 8..47) and ends; the cache off, cat is gone; b, the same
    prompt, hits 64 tokens, past the image: its step encodes nothing."""
    scheduler = make_scheduler(cache_size=0)
    scheduler.add_request(request("a", (image("cat", 8),)))
    run_to_end(scheduler)
    assert "cat" not in scheduler.encoder_cache
    scheduler.add_request(request("b", (image("cat", 8),)))
    first = step(scheduler)
    assert first.scheduled[0].num_computed_tokens == 64 and first.encoder_inputs == ()


def test_a_prefix_hit_inside_the_image_encodes_it_only_if_it_is_gone() -> None:
    """The image spans 40..79; b's prompt leaves a's at 70, so its hit, 64 tokens, ends
    inside the image. Held in the cache: nothing to encode; the cache off: encoded again."""
    for size, expected in ((None, ()), (0, (("b", 0),))):
        scheduler = make_scheduler(cache_size=size)
        scheduler.add_request(request("a", (image("cat", 40),), num_tokens=81))
        run_to_end(scheduler)
        scheduler.add_request(request("b", (image("cat", 40),), num_tokens=81, differ_at=70))
        first = step(scheduler)
        assert first.scheduled[0].num_computed_tokens == 64
        assert first.encoder_inputs == expected


def test_aborts_and_preemption_release_their_images() -> None:
    scheduler = make_scheduler(budget=16)
    scheduler.add_request(request("a", (image("cat", 8),)))
    step(scheduler)
    assert scheduler.encoder_cache.inputs_of("a") == frozenset({0})
    scheduler.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    assert scheduler.encoder_cache.inputs_of("a") == frozenset()
    assert scheduler.encoder_cache.num_freeable == scheduler.encoder_cache.cache_size
    scheduler.add_request(request("b", (image("dog", 8),)))
    step(scheduler)
    victim = scheduler.requests["b"]
    scheduler._preempt(victim)
    assert scheduler.encoder_cache.inputs_of("b") == frozenset()
    assert victim.status == RequestStatus.PREEMPTED
