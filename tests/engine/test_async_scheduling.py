"""The engine with async scheduling gives the synchronous engine's outputs, in order: greedy
and seeded samples, stops on tokens, strings and lengths, preemptions, aborts and a failing
step; it refuses the KV tiers."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from blockserve import LLM
from blockserve.engine.args import EngineArgs
from blockserve.engine.llm_engine import LLMEngine, build_engine
from blockserve.engine.outputs import RequestOutput
from blockserve.engine.request import RequestSpec, SampleId
from blockserve.errors import InvalidConfigError
from blockserve.sampling_params import SamplingParams

PROMPTS = [list(range(5 + i, 5 + i + 3 + 7 * i)) for i in range(10)]


def run_llm(model_dir: Path, params: list[SamplingParams], asynchronous: bool) -> list[tuple]:
    """12 blocks for 6 sequences of up to 100 tokens: preemptions on the way."""
    llm = LLM(
        str(model_dir), dtype="float32", device="cpu", async_scheduling=asynchronous,
        num_gpu_blocks_override=12, max_num_seqs=6, max_num_batched_tokens=64,
    )  # fmt: skip
    results = llm.generate(PROMPTS, params, use_tqdm=False)
    preemptions = llm.get_stats().num_preemptions
    llm.shutdown()
    assert preemptions > 0
    return [
        [(o.token_ids, o.text, o.finish_reason, o.stop_reason) for o in r.outputs] for r in results
    ]


@pytest.mark.slow
def test_greedy_and_seeded_samples_equal_the_synchronous_engine(tiny_llama_dir: Path) -> None:
    params = [
        SamplingParams(temperature=0.0, max_tokens=18 + i, ignore_eos=True)
        if i % 2
        else SamplingParams(temperature=0.9, top_p=0.9, seed=i, n=2, max_tokens=20)
        for i in range(len(PROMPTS))
    ]
    expected = run_llm(tiny_llama_dir, params, asynchronous=False)
    assert run_llm(tiny_llama_dir, params, asynchronous=True) == expected


@pytest.mark.slow
def test_samples_that_need_the_token_in_flight_equal_the_synchronous_engine(
    tiny_llama_dir: Path,
) -> None:
    """Penalties and min_tokens read the token history on the host: such a step waits for
    the one before it; the others beside it are launched ahead."""
    params = [
        SamplingParams(temperature=0.0, max_tokens=20, repetition_penalty=1.5, presence_penalty=0.5)
        if i % 3 == 0
        else SamplingParams(temperature=0.0, max_tokens=20, min_tokens=8, stop_token_ids=[5 + i])
        if i % 3 == 1
        else SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
        for i in range(len(PROMPTS))
    ]
    expected = run_llm(tiny_llama_dir, params, asynchronous=False)
    assert run_llm(tiny_llama_dir, params, asynchronous=True) == expected


@pytest.mark.slow
def test_stops_equal_the_synchronous_engine(tiny_llama_dir: Path) -> None:
    """Stop tokens and stop strings taken from the synchronous run's own outputs, so that
    each stops mid-generation."""
    greedy = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)] * len(PROMPTS)
    free_run = run_llm(tiny_llama_dir, greedy, asynchronous=False)
    params = []
    for i, ((tokens, text, _, _),) in enumerate(free_run):
        middle = text[len(text) // 2 :][:3]
        if i % 2 and middle:
            params.append(dataclasses.replace(greedy[i], stop=[middle]))
        else:
            params.append(dataclasses.replace(greedy[i], stop_token_ids=[tokens[5 + i]]))
    expected = run_llm(tiny_llama_dir, params, asynchronous=False)
    assert {o[0][2] for o in expected} == {"stop"}
    assert run_llm(tiny_llama_dir, params, asynchronous=True) == expected


@pytest.mark.slow
def test_an_abort_and_a_failing_step_leave_the_others_as_they_were(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outputs = {}
    for asynchronous in (False, True):
        engine = build_engine(
            EngineArgs(
                model=str(tiny_llama_dir), dtype="float32", num_gpu_blocks_override=64,
                async_scheduling=asynchronous,
            ).create_configs()
        )  # fmt: skip
        # A fault where the step starts: the synchronous engine runs `execute`, which
        # launches; the asynchronous one launches a step and finishes it later.
        real_launch = engine.core.runner.launch

        def launch(output, real_launch=real_launch):  # type: ignore[no-untyped-def]
            if any(s.request_id == SampleId("bad", 0) for s in output.scheduled):
                raise RuntimeError("injected fault")
            return real_launch(output)

        monkeypatch.setattr(engine.core.runner, "launch", launch)
        for name in ("a", "b", "c"):
            engine.add_request(RequestSpec(name, PROMPTS[ord(name) - 97], greedy))
        finished = run(engine, abort_at=4)
        engine.add_request(RequestSpec("bad", PROMPTS[5], greedy))  # its step fails
        finished.update(run(engine))
        engine.add_request(RequestSpec("d", PROMPTS[6], greedy))
        finished.update(run(engine))
        engine.shutdown()
        outputs[asynchronous] = {
            name: (list(o.outputs[0].token_ids), o.outputs[0].finish_reason)
            for name, o in finished.items()
        }
    # The abort comes between two steps; async scheduling has applied one step fewer then.
    aborted = {asynchronous: outputs[asynchronous].pop("b") for asynchronous in outputs}
    assert aborted[False][0][:3] == aborted[True][0] and len(aborted[False][0]) == 4
    assert {reason for _, reason in aborted.values()} == {"abort"}
    assert outputs[True] == outputs[False]
    assert sorted(outputs[True]) == ["a", "bad", "c", "d"]
    assert outputs[True]["bad"] == ([], "error")
    assert [len(outputs[True][name][0]) for name in "acd"] == [12, 12, 12]


def run(engine: LLMEngine, abort_at: int | None = None) -> dict[str, RequestOutput]:
    """Step until nothing is left (at most 40 steps); abort "b" at step `abort_at`."""
    finished = {}
    for step in range(40):
        if step == abort_at:
            engine.abort_request(["b"])
        finished.update({o.request_id: o for o in engine.step() if o.finished})
        if not engine.has_unfinished_requests():
            return finished
    raise AssertionError("the engine did not finish in 40 steps")


def test_the_kv_tiers_are_refused(tmp_path: Path) -> None:
    with pytest.raises(InvalidConfigError, match=r"async_scheduling .* KV tiers"):
        EngineArgs(async_scheduling=True, kv_cache_dir=str(tmp_path)).create_configs()
