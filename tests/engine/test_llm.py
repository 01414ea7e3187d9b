"""The offline LLM API end to end on a tiny model: prefix hits, stops, n, seeds, failures."""

from __future__ import annotations

from pathlib import Path

import pytest

from blockserve import LLM, SamplingParams
from blockserve.errors import InvalidRequestError
from blockserve.runner.page_mapping import KVPagePopulator
from blockserve.sampling_params import StructuredOutputsParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PROMPT_33 = list(range(10, 43))


def make_llm(model_dir: Path, **kwargs: object) -> LLM:
    kwargs.setdefault("num_gpu_blocks_override", 128)
    return LLM(str(model_dir), dtype="float32", **kwargs)  # type: ignore[arg-type]


def test_second_identical_prompt_hits_32_tokens(tiny_llama_dir: Path) -> None:
    """Two identical 33-token prompts: 0 then 32 cached tokens, same greedy output."""
    llm = make_llm(tiny_llama_dir)
    first = llm.generate(PROMPT_33, GREEDY, use_tqdm=False)[0]
    second = llm.generate(PROMPT_33, GREEDY, use_tqdm=False)[0]
    assert (first.num_cached_tokens, second.num_cached_tokens) == (0, 32)
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    stats = llm.get_stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (66, 32)
    assert stats.kv_cache_usage == 0.0


def test_prefix_caching_off_reports_no_hits(tiny_llama_dir: Path) -> None:
    """With prefix caching off the second identical prompt computes everything."""
    llm = make_llm(tiny_llama_dir, enable_prefix_caching=False)
    outputs = [llm.generate(PROMPT_33, GREEDY, use_tqdm=False)[0] for _ in range(2)]
    assert [o.num_cached_tokens for o in outputs] == [0, 0]


def test_batch_outputs_in_order_with_same_step_sharing(tiny_llama_dir: Path) -> None:
    """Outputs come in prompt order; an identical prompt in the batch hits the first's blocks."""
    llm = make_llm(tiny_llama_dir)
    outputs = llm.generate([PROMPT_33, "hello world", PROMPT_33], GREEDY, use_tqdm=False)
    assert [o.num_cached_tokens for o in outputs] == [0, 0, 32]
    assert outputs[0].outputs[0].token_ids == outputs[2].outputs[0].token_ids
    assert outputs[1].prompt == "hello world"
    assert all(len(o.outputs[0].token_ids) == 12 for o in outputs)
    assert all(o.outputs[0].finish_reason == "length" for o in outputs)


def test_stop_string_cuts_the_text(tiny_llama_dir: Path) -> None:
    """A stop string taken from the greedy text ends generation there, with reason "stop"."""
    llm = make_llm(tiny_llama_dir)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    text = llm.generate("the quick brown", params, use_tqdm=False)[0].outputs[0].text
    stop = text[5:8]
    assert len(stop) == 3 and text.find(stop) == 5
    stopped = llm.generate(
        "the quick brown",
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=[stop]),
        use_tqdm=False,
    )[0].outputs[0]
    assert (stopped.text, stopped.finish_reason, stopped.stop_reason) == (text[:5], "stop", stop)
    assert len(stopped.token_ids) < 24


def test_n_samples_share_the_prompt(tiny_llama_dir: Path) -> None:
    """n=2 gives two outputs (indices 0, 1) from one prompt; seeds make them reproducible."""
    llm = make_llm(tiny_llama_dir)
    params = SamplingParams(n=2, temperature=1.0, max_tokens=10, seed=7, ignore_eos=True)
    first = llm.generate(PROMPT_33, params, use_tqdm=False)[0]
    again = llm.generate(PROMPT_33, params, use_tqdm=False)[0]
    assert [o.index for o in first.outputs] == [0, 1]
    assert [o.token_ids for o in first.outputs] == [o.token_ids for o in again.outputs]
    assert first.outputs[0].token_ids != first.outputs[1].token_ids


def test_different_seeds_differ(tiny_llama_dir: Path) -> None:
    """Seeded sampling depends on the seed."""
    llm = make_llm(tiny_llama_dir)
    outs = [
        llm.generate(
            PROMPT_33,
            SamplingParams(temperature=1.0, max_tokens=10, seed=s, ignore_eos=True),
            use_tqdm=False,
        )[0]
        .outputs[0]
        .token_ids
        for s in (1, 2)
    ]
    assert outs[0] != outs[1]


def test_logprobs_are_returned(tiny_llama_dir: Path) -> None:
    """logprobs=3 gives, per token, its logprob and the top 3 alternatives."""
    llm = make_llm(tiny_llama_dir)
    params = SamplingParams(temperature=0.0, max_tokens=4, logprobs=3, ignore_eos=True)
    out = llm.generate(PROMPT_33, params, use_tqdm=False)[0].outputs[0]
    assert out.logprobs is not None and len(out.logprobs) == 4
    for token, lp in zip(out.token_ids, out.logprobs, strict=True):
        assert lp.token_id == token and lp.rank == 1  # greedy picks the top token
        assert len(lp.top) == 3 and max(lp.top.values()) == pytest.approx(lp.logprob)


def test_bad_requests_raise_and_leave_the_engine_clean(tiny_llama_dir: Path) -> None:
    """Out-of-vocabulary ids, empty or too long prompts, priority under fcfs and prompt
    logprobs (not computed yet) are refused."""
    llm = make_llm(tiny_llama_dir, max_model_len=64)
    for prompt, params, message in [
        ([1, 2, 99999], GREEDY, "out of range"),
        ("", GREEDY, "empty"),
        (list(range(64)), GREEDY, "64 tokens"),
    ]:
        with pytest.raises(InvalidRequestError, match=message):
            llm.generate(prompt, params, use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="priority"):
        llm.generate("hi", GREEDY, priority=[1], use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="prompt_logprobs must be at most 20"):
        llm.generate("hi", SamplingParams(prompt_logprobs=21), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    assert llm.generate("hi", GREEDY, use_tqdm=False)[0].finished


def test_chat_applies_the_template(tiny_llama_dir: Path) -> None:
    """chat() renders the chat template and generates from it."""
    llm = make_llm(tiny_llama_dir)
    out = llm.chat([{"role": "user", "content": "hello"}], GREEDY, use_tqdm=False)[0]
    tokenizer = llm.get_tokenizer()
    expected = tokenizer.encode("<|user|>hello<eos><|assistant|>", add_special_tokens=False)
    assert list(out.prompt_token_ids) == expected
    assert len(out.outputs[0].token_ids) == 12


def test_context_is_capped_by_the_kv_cache(tiny_llama_dir: Path) -> None:
    """A cache of 4 usable blocks caps the context at 64 tokens; asking for more is an error."""
    from blockserve.errors import InvalidConfigError

    llm = make_llm(tiny_llama_dir, num_gpu_blocks_override=5)
    assert llm.engine.max_model_len == 64
    with pytest.raises(InvalidRequestError, match="the context is 64 tokens"):
        llm.generate(list(range(70)), GREEDY, use_tqdm=False)
    with pytest.raises(InvalidConfigError, match="exceeds the KV cache, which holds 64 tokens"):
        make_llm(tiny_llama_dir, num_gpu_blocks_override=5, max_model_len=100)


def test_structured_output_rows_leave_their_neighbours_alone(tiny_llama_dir: Path) -> None:
    """A constrained sample in the batch: its text is one of the choices and it stops at
    EOS; the unconstrained neighbour's tokens equal those it gets in a batch of its own."""
    llm = make_llm(tiny_llama_dir)
    choice = SamplingParams(
        temperature=0.0,
        max_tokens=12,
        structured_outputs=StructuredOutputsParams(choice=["alpha", "beta"]),
    )
    alone = llm.generate(PROMPT_33, GREEDY, use_tqdm=False)[0]
    both = llm.generate([PROMPT_33, PROMPT_33[:20]], [GREEDY, choice], use_tqdm=False)
    assert both[0].outputs[0].token_ids == alone.outputs[0].token_ids
    constrained = both[1].outputs[0]
    assert constrained.text in ("alpha", "beta")
    assert constrained.finish_reason == "stop"
    assert llm.get_stats().kv_cache_usage == 0.0


@pytest.mark.parametrize(
    ("params", "param"),
    [
        (
            SamplingParams(structured_outputs=StructuredOutputsParams(regex="(")),
            "structured_outputs",
        ),
        (
            SamplingParams(ignore_eos=True, structured_outputs=StructuredOutputsParams(regex="a")),
            "ignore_eos",
        ),
        (
            SamplingParams(min_tokens=2, structured_outputs=StructuredOutputsParams(regex="a")),
            "min_tokens",
        ),
    ],
)
def test_bad_constraint_is_refused_before_queueing(
    tiny_llama_dir: Path, params: SamplingParams, param: str
) -> None:
    llm = make_llm(tiny_llama_dir)
    with pytest.raises(InvalidRequestError) as caught:
        llm.generate(PROMPT_33, params, use_tqdm=False)
    assert caught.value.param == param
    assert llm.get_stats().num_waiting == 0 and llm.get_stats().num_running == 0


def test_ready_with_a_steps_blocks_mapped_and_shut_down_without_its_thread(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A CPU engine maps in the blocks one step can take before it is ready
    (max_num_batched_tokens 64 / 16 + 2 sequences = 6 blocks), keeps 12 past the highest
    written, and shutdown() ends the thread that maps them."""
    asked: list[int] = []
    map_now = KVPagePopulator.map_now

    def recording_map_now(populator: KVPagePopulator, num_blocks: int) -> bool:
        asked.append(num_blocks)
        return map_now(populator, num_blocks)

    monkeypatch.setattr(KVPagePopulator, "map_now", recording_map_now)
    llm = make_llm(tiny_llama_dir, max_num_batched_tokens=64, max_num_seqs=2)
    pages = llm.engine.core.runner.kv_pages
    assert pages is not None and pages.ahead == 12
    assert asked == [6] and pages.mapped_blocks >= 6
    llm.generate(PROMPT_33, GREEDY, use_tqdm=False)  # writes blocks 1-3
    assert pages.wait_mapped(4 + 12, timeout=30.0)
    llm.shutdown()
    assert not pages._thread.is_alive()
