"""The sampler: greedy, filters, seeds, penalties and logprobs, all batched."""

from __future__ import annotations

import math

import pytest
import torch

from blockserve.model.sampler import (
    Sampler,
    SamplingBatch,
    SamplingRow,
    apply_filters,
    apply_penalties,
)
from blockserve.sampling_params import SamplingParams

VOCAB = 4


def batch_of(params: list[SamplingParams], **row_kwargs: object) -> SamplingBatch:
    rows = [SamplingRow(p, [0], [], None, **row_kwargs) for p in params]  # type: ignore[arg-type]
    return SamplingBatch.build(rows, VOCAB, torch.device("cpu"))


def logits_of(probs: list[float], rows: int = 1) -> torch.Tensor:
    return torch.tensor([probs] * rows).log()


def test_temperature_zero_is_argmax() -> None:
    """Greedy rows take the argmax of each row."""
    logits = torch.randn(8, 50, generator=torch.Generator().manual_seed(0))
    rows = [SamplingRow(SamplingParams(temperature=0.0), [0], [], None) for _ in range(8)]
    out = Sampler()(logits, SamplingBatch.build(rows, 50, torch.device("cpu")))
    assert out.token_ids.tolist() == logits.argmax(dim=-1).tolist()


def test_greedy_takes_bf16_logits_as_they_are_and_others_widen_them() -> None:
    """The LM head's bf16 logits: a greedy batch's tokens are the argmax of the logits as
    they are (ties and NaN as torch.max); a batch that asks for logprobs computes them on the
    logits widened to float32, exactly."""
    logits = torch.randint(-4, 4, (6, 50), generator=torch.Generator().manual_seed(1)).bfloat16()
    logits[2, 7] = float("nan")
    expected = logits.float().max(dim=-1).indices.tolist()
    greedy = [SamplingRow(SamplingParams(temperature=0.0), [0], [], None) for _ in range(6)]
    out = Sampler()(logits, SamplingBatch.build(greedy, 50, torch.device("cpu")))
    assert out.token_ids.tolist() == expected
    assert out.logprobs is None
    with_logprobs = [SamplingRow(SamplingParams(temperature=0.0, logprobs=2), [0], [], None)]
    out = Sampler()(logits[3:], SamplingBatch.build(with_logprobs * 3, 50, torch.device("cpu")))
    raw = logits[3:].float().log_softmax(dim=-1)
    assert out.token_ids.tolist() == expected[3:]
    assert out.logprobs is not None and out.logprobs.dtype == torch.float32
    assert out.logprobs.tolist() == raw.gather(1, out.token_ids[:, None])[:, 0].tolist()


def test_top_k_never_leaves_the_top_k() -> None:
    """2,000 draws with top_k=2 only ever give the two most likely tokens."""
    logits = logits_of([0.1, 0.4, 0.2, 0.3], rows=2000)
    batch = batch_of([SamplingParams(top_k=2)] * 2000)
    tokens = Sampler(torch.Generator().manual_seed(0))(logits, batch).token_ids
    assert set(tokens.tolist()) == {1, 3}


def test_top_p_keeps_the_nucleus() -> None:
    """top_p=0.7 over (0.5, 0.3, 0.15, 0.05) keeps the first two tokens only."""
    filtered = apply_filters(
        logits_of([0.5, 0.3, 0.15, 0.05]), batch_of([SamplingParams(top_p=0.7)])
    )
    assert torch.isfinite(filtered).tolist() == [[True, True, False, False]]


def test_min_p_drops_tokens_below_the_scaled_max() -> None:
    """min_p=0.5 keeps tokens with probability >= 0.5 × 0.5 = 0.25."""
    filtered = apply_filters(
        logits_of([0.5, 0.3, 0.15, 0.05]), batch_of([SamplingParams(min_p=0.5)])
    )
    assert torch.isfinite(filtered).tolist() == [[True, True, False, False]]


def test_filters_are_per_row() -> None:
    """Each row keeps its own top-k; an unfiltered row keeps everything."""
    batch = batch_of([SamplingParams(top_k=1), SamplingParams(top_k=3), SamplingParams()])
    filtered = apply_filters(logits_of([0.1, 0.4, 0.2, 0.3], rows=3), batch)
    assert torch.isfinite(filtered).tolist() == [
        [False, True, False, False],
        [False, True, True, True],
        [True, True, True, True],
    ]


def test_same_seed_same_tokens_in_any_batch() -> None:
    """A seeded request draws the same tokens whatever else shares its batch."""
    logits = logits_of([0.25, 0.25, 0.25, 0.25], rows=3)

    def draws(row: int) -> list[int]:
        generator = torch.Generator().manual_seed(1234)
        tokens = []
        for _ in range(20):
            rows = [SamplingRow(SamplingParams(), [0], [], None) for _ in range(3)]
            rows[row] = SamplingRow(SamplingParams(seed=1234), [0], [], generator)
            batch = SamplingBatch.build(rows, VOCAB, torch.device("cpu"))
            tokens.append(Sampler()(logits, batch).token_ids[row].item())
        return tokens

    first = draws(0)
    assert draws(2) == first
    assert len(set(first)) > 1  # it really samples


def test_penalties_follow_their_definitions() -> None:
    """Repetition divides/multiplies seen tokens; frequency and presence subtract."""
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0]])
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    # prompt holds token 1; output holds token 0 twice and token 2 once
    batch = SamplingBatch.build(
        [SamplingRow(params, [1], [0, 2, 0], None)], VOCAB, torch.device("cpu")
    )
    penalised = apply_penalties(logits, batch)
    expected = [2.0 / 2 - 0.5 * 2 - 0.25, -1.0 * 2, 0.5 / 2 - 0.5 * 1 - 0.25, 3.0]
    assert penalised.tolist() == [pytest.approx(expected)]


def test_banned_tokens_are_never_sampled() -> None:
    """Tokens banned before min_tokens (EOS) are not chosen even when they are the argmax."""
    logits = logits_of([0.7, 0.1, 0.1, 0.1])
    batch = batch_of([SamplingParams(temperature=0.0)], banned_token_ids=(0,))
    assert Sampler()(logits, batch).token_ids.tolist() == [1]


def test_logprobs_are_of_the_raw_distribution() -> None:
    """The chosen token's logprob, its rank, and the top-N, from the unprocessed logits."""
    probs = [0.1, 0.4, 0.2, 0.3]
    batch = batch_of([SamplingParams(temperature=0.0, logprobs=2)])
    out = Sampler()(logits_of(probs), batch)
    assert out.token_ids.tolist() == [1]
    assert out.logprobs is not None and out.ranks is not None
    assert out.logprobs.item() == pytest.approx(math.log(0.4))
    assert out.ranks.tolist() == [1]
    assert out.top_ids is not None and out.top_logprobs is not None
    assert out.top_ids.tolist() == [[1, 3]]
    assert out.top_logprobs[0].tolist() == pytest.approx([math.log(0.4), math.log(0.3)])
