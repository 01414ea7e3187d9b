"""The engine core on a tiny model: token ids in, token ids out, as plain picklable data."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest

from blockserve.core.explain import CacheExplanation
from blockserve.engine.args import EngineArgs
from blockserve.engine.core import EngineCore
from blockserve.engine.outputs import EngineCoreOutputs
from blockserve.engine.request import EngineCoreRequest, SampleId
from blockserve.sampling_params import SamplingParams
from blockserve.sched.request import RequestStatus

PROMPT_33 = tuple(range(10, 43))
TWO_TOKENS = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)


@pytest.fixture(scope="module")
def core(tiny_llama_dir: Path) -> EngineCore:
    args = EngineArgs(model=str(tiny_llama_dir), dtype="float32", num_gpu_blocks_override=32)
    return EngineCore(args.create_configs())


def run_to_end(core: EngineCore) -> list[EngineCoreOutputs]:
    steps = []
    for _ in range(10):  # two tokens per request: a few steps at most
        steps.append(core.step())
        if not core.has_unfinished_requests():
            return steps
    raise AssertionError("the core did not finish in 10 steps")


def test_token_ids_in_token_ids_out_with_hits(core: EngineCore) -> None:
    """A 33-token prompt is admitted with 0 cached tokens and yields 2 tokens; the same prompt
    again is admitted with 32 cached and yields the same tokens."""
    outputs = []
    for name in ("a", "b"):
        core.add_request(EngineCoreRequest(SampleId(name, 0), PROMPT_33, TWO_TOKENS))
        outputs.append(run_to_end(core))
    (first_a, second_a), (first_b, second_b) = outputs
    assert (first_a.started, first_b.started) == (
        ((SampleId("a", 0), 0, None, {}),),
        ((SampleId("b", 0), 32, None, {}),),
    )
    tokens_a = [u.new_token_ids[0] for u in (*first_a.updates, *second_a.updates)]
    tokens_b = [u.new_token_ids[0] for u in (*first_b.updates, *second_b.updates)]
    assert tokens_a == tokens_b and len(tokens_a) == 2
    assert second_b.updates[0].status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert core.kv_cache_report().integrity_errors == ()


def test_outputs_survive_pickling(core: EngineCore) -> None:
    """What a step returns is plain data: it could cross a process boundary unchanged."""
    core.add_request(EngineCoreRequest(SampleId("p", 1), PROMPT_33, TWO_TOKENS))
    for outputs in run_to_end(core):
        assert pickle.loads(pickle.dumps(outputs)) == outputs


def test_abort_frees_every_block(core: EngineCore) -> None:
    """An aborted sample holds no block afterwards; its blocks stay cached."""
    long = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)
    core.add_request(EngineCoreRequest(SampleId("x", 0), tuple(range(100, 140)), long))
    core.step()
    assert core.kv_cache_report().num_requests_holding_blocks == 1
    core.abort_requests([SampleId("x", 0)])
    report = core.kv_cache_report()
    assert (report.num_requests_holding_blocks, report.usage) == (0, 0.0)
    assert report.num_cached_hashes >= 2 and not core.has_unfinished_requests()


def test_a_failing_model_step_fails_its_samples_only(
    core: EngineCore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The step's samples come back in `errors` (the exception's type, not its text) and are
    freed; the core serves the next one."""
    real_execute = core.runner.execute
    monkeypatch.setattr(core.runner, "execute", lambda output: 1 / 0)
    core.add_request(EngineCoreRequest(SampleId("bad", 0), PROMPT_33, TWO_TOKENS))
    failed = core.step()
    assert dict(failed.errors) == {
        SampleId("bad", 0): "the model step failed (ZeroDivisionError); the server log has details"
    }
    assert failed.updates == () and core.kv_cache_report().usage == 0.0
    monkeypatch.setattr(core.runner, "execute", real_execute)
    core.add_request(EngineCoreRequest(SampleId("good", 0), PROMPT_33, TWO_TOKENS))
    assert run_to_end(core)[-1].updates[0].status == RequestStatus.FINISHED_LENGTH_CAPPED


def test_a_sample_whose_sampling_fails_fails_alone(core: EngineCore) -> None:
    """A stop token id outside the vocabulary (banned while min_tokens holds) breaks sampling;
    that sample fails with its own error, the one batched with it gets its tokens."""
    poisoned = SamplingParams(max_tokens=2, min_tokens=1, stop_token_ids=(10**9,))
    core.add_request(EngineCoreRequest(SampleId("bad", 0), PROMPT_33, poisoned))
    core.add_request(EngineCoreRequest(SampleId("good", 0), tuple(range(60, 80)), TWO_TOKENS))
    first = core.step()
    (error,) = first.errors.values()
    assert list(first.errors) == [SampleId("bad", 0)] and error.startswith("IndexError")
    assert [u.request_id for u in first.updates] == [SampleId("good", 0)]
    steps = run_to_end(core)
    assert steps[-1].updates[0].status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert core.kv_cache_report().num_requests_holding_blocks == 0


def test_the_miss_ratio_curve_follows_the_traffic(tiny_llama_dir: Path) -> None:
    """The same 33-token prompt twice: this 31-block cache hits 32 of 66 tokens, and so would
    an LRU cache of every size on the curve (the prompt's 2 blocks were the last used)."""
    args = EngineArgs(model=str(tiny_llama_dir), dtype="float32", num_gpu_blocks_override=32)
    core = EngineCore(args.create_configs())
    for name in ("a", "b"):
        core.add_request(EngineCoreRequest(SampleId(name, 0), PROMPT_33, TWO_TOKENS))
        run_to_end(core)
    capacities = (4, 8, 16, 31, 62, 124, 248)  # 31 usable blocks x 2^-3 .. 2^3
    assert core.estimated_hit_rates() == tuple((c, 32 / 66) for c in capacities)
    report = core.miss_ratio_report()
    assert (report.num_blocks, report.num_requests, report.actual_hit_rate) == (31, 2, 0.48485)
    assert [p.capacity_blocks for p in report.points][:3] == [2, 3, 4]  # 31/16, 31/11.3, 31/8
    assert len(report.points) == 17 and report.points[-1].capacity_blocks == 496
    assert {p.estimated_hit_rate for p in report.points} == {0.48485}


@pytest.mark.parametrize("options", [{"enable_prefix_caching": False}, {"miss_ratio_samples": 0}])
def test_no_curve_without_prefix_caching_or_samples(
    tiny_llama_dir: Path, options: dict[str, object]
) -> None:
    """Prefix caching off (nothing to estimate) or a zero budget: no gauges, no points."""
    args = EngineArgs(
        model=str(tiny_llama_dir),
        dtype="float32",
        num_gpu_blocks_override=32,
        **options,  # type: ignore[arg-type]
    )
    core = EngineCore(args.create_configs())
    assert core.estimated_hit_rates() == () and core.miss_ratio_report().points == ()


def test_cache_explanations_on_a_real_engine(tiny_llama_dir: Path) -> None:
    """7 usable blocks of 16. Each reason as the core reports it when a sample starts, with
    the cached tokens beside it; the explanation is taken before the sample's own blocks are
    stored (the first sample reads never_stored, not partial_block)."""
    args = EngineArgs(model=str(tiny_llama_dir), dtype="float32", num_gpu_blocks_override=8)
    core = EngineCore(args.create_configs())

    def started(name: str, prompt: tuple[int, ...], salt: str | None = None) -> object:
        core.add_request(
            EngineCoreRequest(
                SampleId(name, 0), prompt, TWO_TOKENS, cache_salt=salt, explain_cache=True
            )
        )
        ((_, num_cached, explanation, _),) = run_to_end(core)[0].started
        return num_cached, explanation

    assert started("a", PROMPT_33) == (0, CacheExplanation(0, "never_stored"))
    assert started("b", PROMPT_33) == (32, CacheExplanation(2, "partial_block"))
    assert started("c", PROMPT_33[:32]) == (16, CacheExplanation(1, "last_token"))
    # Salted, the same tokens read as never stored: a salt's content is never told.
    assert started("d", PROMPT_33, salt="t") == (0, CacheExplanation(0, "never_stored"))
    started("flood", tuple(range(100, 196)))  # 96 + 2 tokens: all 7 blocks, every hash evicted
    num_cached, explanation = started("e", PROMPT_33)  # type: ignore[misc]
    assert (num_cached, explanation.first_missing_block, explanation.reason) == (0, 0, "evicted")
    assert 0.0 <= explanation.evicted_seconds_ago < 60.0
    core.add_request(EngineCoreRequest(SampleId("quiet", 0), PROMPT_33, TWO_TOKENS))
    assert run_to_end(core)[0].started == ((SampleId("quiet", 0), 32, None, {}),)  # did not ask
