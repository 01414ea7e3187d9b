"""prompt_logprobs and logit_bias through the offline engine on a tiny model, against
transformers' float32 logits: every prompt position's logprob, rank and top-k across chunked
prefills (and under async scheduling), the prefix cache not read, a bias that forces or bans a
token while logprobs stay those of the raw distribution."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from blockserve import LLM, SamplingParams
from blockserve.engine.outputs import Logprob
from blockserve.errors import InvalidRequestError
from blockserve.sampling_params import MAX_LOGIT_BIAS_ENTRIES
from tests.runner.test_model_runner import reference_logits

PROMPT = [(7 * i + 3) % 250 + 1 for i in range(70)]  # three chunks of 32 tokens
ATOL = 1e-4


def make_llm(model_dir: Path, **kwargs: object) -> LLM:
    return LLM(
        str(model_dir), dtype="float32", num_gpu_blocks_override=64, max_num_batched_tokens=32,
        **kwargs,  # type: ignore[arg-type]
    )  # fmt: skip


@pytest.fixture(scope="module")
def llm(tiny_llama_dir: Path) -> LLM:
    return make_llm(tiny_llama_dir)


@pytest.fixture(scope="module")
def raw_logits(tiny_llama_dir: Path) -> torch.Tensor:
    return reference_logits(tiny_llama_dir, PROMPT)


def expected_prompt_logprobs(raw: torch.Tensor, num_top: int) -> list[Logprob]:
    logprobs = raw.log_softmax(dim=-1)
    expected = []
    for position in range(len(PROMPT) - 1):
        row, token = logprobs[position], PROMPT[position + 1]
        top = row.topk(num_top)
        expected.append(
            Logprob(
                token_id=token,
                logprob=float(row[token]),
                rank=int((row > row[token]).sum()) + 1,
                top=dict(zip(top.indices.tolist(), top.values.tolist(), strict=True)),
            )
        )
    return expected


def assert_close(got: Logprob | None, want: Logprob) -> None:
    assert got is not None
    assert (got.token_id, got.rank, list(got.top)) == (want.token_id, want.rank, list(want.top))
    assert got.logprob == pytest.approx(want.logprob, abs=ATOL)
    assert list(got.top.values()) == pytest.approx(list(want.top.values()), abs=ATOL)


@pytest.mark.parametrize("asynchronous", [False, True])
def test_prompt_logprobs_equal_transformers(
    tiny_llama_dir: Path, raw_logits: torch.Tensor, asynchronous: bool
) -> None:
    """A 70-token prompt prefilled in three chunks beside a request that asks for none; the
    same prompt again reads no cached block and gives the same values."""
    llm = make_llm(tiny_llama_dir, async_scheduling=asynchronous)
    asking = SamplingParams(temperature=0.0, max_tokens=4, prompt_logprobs=3)
    plain = SamplingParams(temperature=0.0, max_tokens=4)
    first, other = llm.generate(
        [{"prompt_token_ids": PROMPT}, {"prompt_token_ids": PROMPT[:40]}],
        [asking, plain],
        use_tqdm=False,
    )
    again = llm.generate({"prompt_token_ids": PROMPT}, asking, use_tqdm=False)[0]
    expected = expected_prompt_logprobs(raw_logits, 3)
    for output in (first, again):
        assert output.prompt_logprobs is not None
        assert len(output.prompt_logprobs) == len(PROMPT)
        assert output.prompt_logprobs[0] is None
        for got, want in zip(output.prompt_logprobs[1:], expected, strict=True):
            assert_close(got, want)
    assert other.prompt_logprobs is None
    assert again.num_cached_tokens == 0
    assert again.outputs[0].token_ids == first.outputs[0].token_ids


def test_zero_prompt_logprobs_give_each_token_alone(raw_logits: torch.Tensor, llm: LLM) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    output = llm.generate({"prompt_token_ids": PROMPT}, params, use_tqdm=False)[0]
    expected = expected_prompt_logprobs(raw_logits, 0)
    assert output.prompt_logprobs is not None
    for got, want in zip(output.prompt_logprobs[1:], expected, strict=True):
        assert_close(got, want)


def test_logit_bias_moves_the_choice_not_the_logprobs(raw_logits: torch.Tensor, llm: LLM) -> None:
    logits = raw_logits[-1]
    best, second = logits.topk(2).indices.tolist()
    greedy = SamplingParams(temperature=0.0, max_tokens=1, logprobs=1)
    banned = SamplingParams(temperature=0.0, max_tokens=1, logprobs=1, logit_bias={best: -100})
    forced = SamplingParams(temperature=0.0, max_tokens=5, logit_bias={"17": 100})
    prompt = {"prompt_token_ids": PROMPT}
    plain, without_best, seventeen = llm.generate(
        [prompt] * 3, [greedy, banned, forced], use_tqdm=False
    )
    assert plain.outputs[0].token_ids == (best,)
    assert without_best.outputs[0].token_ids == (second,)
    assert seventeen.outputs[0].token_ids == (17,) * 5
    raw = logits.log_softmax(dim=-1)
    chosen = without_best.outputs[0].logprobs
    assert chosen is not None and chosen[0].rank == 2
    assert chosen[0].logprob == pytest.approx(float(raw[second]), abs=ATOL)


@pytest.mark.parametrize(
    ("bias", "message"),
    [
        ({"1000000": 1.0}, "logit_bias token id 1000000 is out of range for a vocabulary of 320"),
        ({"x": 1.0}, "logit_bias must map token ids to numbers, got 'x': 1.0"),
        ({"3": "up"}, "logit_bias must map token ids to numbers, got '3': 'up'"),
        ({"3": float("nan")}, "logit_bias values must be finite, got nan"),
        (
            {"9" * 100_000: 1.0},
            f"logit_bias must map token ids to numbers, got '{'9' * 36}...: 1.0",
        ),
        ({"\u0663": 1.0}, "logit_bias must map token ids to numbers, got '\u0663': 1.0"),
        (
            {str(i): 1.0 for i in range(MAX_LOGIT_BIAS_ENTRIES + 1)},
            "logit_bias may have at most 300 entries, got 301",
        ),
    ],
)
def test_bad_logit_bias_is_refused(llm: LLM, bias: dict, message: str) -> None:
    with pytest.raises(InvalidRequestError) as error:
        llm.generate("hi", SamplingParams(logit_bias=bias), use_tqdm=False)
    assert (str(error.value), error.value.param) == (message, "logit_bias")


def test_logit_bias_is_clamped_and_keyed_by_int() -> None:
    params = SamplingParams(logit_bias={"3": 250.0, 4: -1e9, 5: 0.5})
    assert params.logit_bias == {3: 100.0, 4: -100.0, 5: 0.5}
    assert SamplingParams(logit_bias={}).logit_bias is None


@pytest.mark.parametrize("asynchronous", [False, True])
def test_n_choices_share_one_computation_of_the_prompt(
    tiny_llama_dir: Path, raw_logits: torch.Tensor, asynchronous: bool
) -> None:
    """n = 4 with prompt logprobs: sample 0 computes the prompt and its logprobs; the other
    three start once it is cached and read its 4 full blocks (3 x 64 hit tokens), computing
    no prompt logprobs. Every choice shows the same, correct prompt logprobs."""
    llm = make_llm(tiny_llama_dir, async_scheduling=asynchronous)
    before = llm.engine.stats()
    params = SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=2, n=4)
    output = llm.generate({"prompt_token_ids": PROMPT}, params, use_tqdm=False)[0]
    after = llm.engine.stats()
    assert after.prefix_cache_hits - before.prefix_cache_hits == 3 * 64
    assert output.prompt_logprobs is not None
    expected = expected_prompt_logprobs(raw_logits, 2)
    for got, want in zip(output.prompt_logprobs[1:], expected, strict=True):
        assert_close(got, want)
    assert len({choice.token_ids for choice in output.outputs}) == 1
    assert [len(choice.token_ids) for choice in output.outputs] == [3, 3, 3, 3]
