"""LLMEngine: input processor, core and output processor joined; step failures stay local,
sample ids are structured, a live id cannot be reused."""

from __future__ import annotations

from pathlib import Path

import pytest

from blockserve.engine.args import EngineArgs
from blockserve.engine.llm_engine import LLMEngine, build_engine
from blockserve.engine.outputs import RequestOutput
from blockserve.engine.request import RequestSpec, SampleId
from blockserve.errors import InvalidRequestError
from blockserve.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PROMPT_33 = tuple(range(10, 43))


def make_engine(model_dir: Path) -> LLMEngine:
    args = EngineArgs(model=str(model_dir), dtype="float32", num_gpu_blocks_override=128)
    return build_engine(args.create_configs())


def run_to_completion(engine: LLMEngine) -> dict[str, RequestOutput]:
    """Step until nothing is left (12 tokens per request: 20 steps is a safe bound)."""
    finished = {}
    for _ in range(20):
        finished.update({o.request_id: o for o in engine.step() if o.finished})
        if not engine.has_unfinished_requests():
            return finished
    raise AssertionError("the engine did not finish in 20 steps")


def test_failing_step_fails_only_its_requests(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A request that raises inside the step fails alone; the next request succeeds."""
    engine = make_engine(tiny_llama_dir)
    real_execute = engine.core.runner.execute

    def execute(output):  # type: ignore[no-untyped-def]
        if any(s.request_id == SampleId("bad", 0) for s in output.scheduled):
            raise RuntimeError("injected fault")
        return real_execute(output)

    monkeypatch.setattr(engine.core.runner, "execute", execute)
    engine.add_request(RequestSpec("bad", PROMPT_33, GREEDY))
    (failed,) = engine.step()
    assert failed.finished and failed.outputs[0].finish_reason == "error"
    assert failed.error == "the model step failed (RuntimeError); the server log has details"
    assert engine.stats().kv_cache_usage == 0.0
    engine.add_request(RequestSpec("good", PROMPT_33, GREEDY))
    good = run_to_completion(engine)["good"]
    assert good.outputs[0].finish_reason == "length" and len(good.outputs[0].token_ids) == 12


def test_sample_ids_are_structured_and_cannot_collide(tiny_llama_dir: Path) -> None:
    """n=2 on id "y" runs samples ("y", 0) and ("y", 1), beside a live request named "1_y"."""
    engine = make_engine(tiny_llama_dir)
    engine.add_request(RequestSpec("1_y", PROMPT_33, GREEDY))
    engine.add_request(RequestSpec("y", PROMPT_33, SamplingParams(n=2, max_tokens=2)))
    assert [r.request_id for r in engine.core.scheduler.waiting] == [
        SampleId("1_y", 0),
        SampleId("y", 0),
        SampleId("y", 1),
    ]
    finished = run_to_completion(engine)
    assert sorted(finished) == ["1_y", "y"]
    assert [len(c.token_ids) for c in finished["y"].outputs] == [2, 2]
    assert engine.stats().kv_cache_usage == 0.0


def test_duplicate_request_id_is_refused(tiny_llama_dir: Path) -> None:
    """A live request's id cannot be reused; the refusal leaves the first request alone."""
    engine = make_engine(tiny_llama_dir)
    engine.add_request(RequestSpec("x", PROMPT_33, GREEDY))
    with pytest.raises(InvalidRequestError, match="'x' is already in use"):
        engine.add_request(RequestSpec("x", "hello", GREEDY))
    assert [r.request_id for r in engine.core.scheduler.waiting] == [SampleId("x", 0)]
