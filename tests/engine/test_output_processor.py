"""The output processor without a model: fan-out of `n`, fan-in of updates, stop strings,
failures and aborts, and the token counters."""

from __future__ import annotations

from blockserve.core.explain import CacheExplanation
from blockserve.engine.output_processor import OutputProcessor
from blockserve.engine.outputs import EngineCoreOutputs
from blockserve.engine.request import RequestSpec, SampleId, ValidatedRequest
from blockserve.sampling_params import SamplingParams
from blockserve.sched.output import RequestUpdate
from blockserve.sched.request import RequestStatus

RUNNING, LENGTH = RequestStatus.RUNNING, RequestStatus.FINISHED_LENGTH_CAPPED


class CharTokenizer:
    """Token id n is the character chr(n)."""

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(t) for t in token_ids)


def add(processor: OutputProcessor, request_id: str, params: SamplingParams) -> list[SampleId]:
    request = ValidatedRequest(RequestSpec(request_id, (65, 66, 67), params), (65, 66, 67))
    return [r.request_id for r in processor.add_request(request)]


def step(*updates: RequestUpdate, **kwargs: object) -> EngineCoreOutputs:
    return EngineCoreOutputs(1.0, updates, **kwargs)  # type: ignore[arg-type]


def test_n_samples_fan_out_with_structured_ids_and_seeds() -> None:
    """n=3 becomes three core requests ("r", 0..2), each n=1 with seed + index."""
    processor = OutputProcessor(CharTokenizer())
    request = ValidatedRequest(RequestSpec("r", (1, 2), SamplingParams(n=3, seed=10)), (1, 2))
    core_requests = processor.add_request(request)
    assert [r.request_id for r in core_requests] == [
        SampleId("r", 0),
        SampleId("r", 1),
        SampleId("r", 2),
    ]
    assert [(r.sampling_params.n, r.sampling_params.seed) for r in core_requests] == [
        (1, 10),
        (1, 11),
        (1, 12),
    ]
    assert "r" in processor and len(processor) == 1


def test_updates_fan_in_to_one_output_per_request() -> None:
    """Two samples' tokens in one step give one RequestOutput holding both; the request is
    forgotten once both finish."""
    processor = OutputProcessor(CharTokenizer())
    first, second = add(processor, "r", SamplingParams(n=2, max_tokens=2))
    explanation = CacheExplanation(1, "partial_block")
    started = ((first, 16, explanation, {}), (second, 16, explanation, {}))
    tokens = (RequestUpdate(first, (104,), RUNNING), RequestUpdate(second, (105,), RUNNING))
    (output,) = processor.process(step(*tokens, started=started)).request_outputs
    assert [c.text for c in output.outputs] == ["h", "i"]
    assert (output.num_cached_tokens, output.finished, output.metrics.first_scheduled_time) == (
        16,
        False,
        1.0,
    )
    assert output.cache_explanation == explanation
    processed = processor.process(
        step(RequestUpdate(first, (33,), LENGTH), RequestUpdate(second, (63,), LENGTH))
    )
    (final,) = processed.request_outputs
    assert [(c.text, c.finish_reason) for c in final.outputs] == [
        ("h!", "length"),
        ("i?", "length"),
    ]
    assert final.finished and "r" not in processor and processed.samples_to_abort == []
    assert (processor.num_prompt_tokens, processor.num_generation_tokens) == (3, 4)


def test_final_only_builds_outputs_for_finished_requests_alone() -> None:
    """With `final_only` (the offline API) a step's output list holds the requests it ended,
    with all their text; a request that only advanced gets none, though its tokens count."""
    processor = OutputProcessor(CharTokenizer())
    (running,) = add(processor, "running", SamplingParams(max_tokens=3))
    (ending,) = add(processor, "ending", SamplingParams(max_tokens=2))
    first = processor.process(
        step(RequestUpdate(running, (104,), RUNNING), RequestUpdate(ending, (105,), RUNNING)),
        final_only=True,
    )
    assert first.request_outputs == []
    second = processor.process(
        step(RequestUpdate(running, (106,), RUNNING), RequestUpdate(ending, (33,), LENGTH)),
        final_only=True,
    )
    assert [(o.request_id, o.outputs[0].text, o.finished) for o in second.request_outputs] == [
        ("ending", "i!", True)
    ]
    assert "running" in processor and "ending" not in processor
    assert processor.num_generation_tokens == 4


def test_a_stop_string_ends_the_sample_and_asks_the_core_to_abort_it() -> None:
    """Text reaching a stop string finishes that sample with reason "stop"; the core is told
    to abort it, its sibling runs on."""
    processor = OutputProcessor(CharTokenizer())
    first, second = add(processor, "r", SamplingParams(n=2, stop=["xy"]))
    processor.process(step(RequestUpdate(first, (120,), RUNNING)))
    processed = processor.process(
        step(RequestUpdate(first, (121,), RUNNING), RequestUpdate(second, (122,), RUNNING))
    )
    (output,) = processed.request_outputs
    assert processed.samples_to_abort == [first]
    # The running sibling's "z" is held back: a stop string of 2 may still begin with it.
    assert [(c.text, c.finish_reason, c.stop_reason) for c in output.outputs] == [
        ("", "stop", "xy"),
        ("", None, None),
    ]
    assert not output.finished and "r" in processor


def test_a_failed_sample_fails_its_request_and_its_siblings() -> None:
    """An error on one sample ends every sample with "error"; the siblings go to abort."""
    processor = OutputProcessor(CharTokenizer())
    first, second = add(processor, "r", SamplingParams(n=2))
    processed = processor.process(step(errors={first: "RuntimeError: boom"}))
    (output,) = processed.request_outputs
    assert (output.error, [c.finish_reason for c in output.outputs]) == (
        "RuntimeError: boom",
        ["error", "error"],
    )
    assert processed.samples_to_abort == [first, second] and "r" not in processor


def test_abort_returns_the_final_output_and_every_unfinished_sample() -> None:
    """Aborting a request ends it now; unknown ids are ignored."""
    processor = OutputProcessor(CharTokenizer())
    first, second = add(processor, "r", SamplingParams(n=2))
    aborted = processor.abort(["r", "never-seen"])
    (output,) = aborted.request_outputs
    assert [c.finish_reason for c in output.outputs] == ["abort", "abort"]
    assert aborted.samples_to_abort == [first, second] and len(processor) == 0
