"""SamplingParams: vLLM's defaults, normalised stops, and one typed error per bad field."""

from __future__ import annotations

import pytest

from blockserve.errors import InvalidRequestError
from blockserve.sampling_params import SamplingParams


def test_defaults_and_normalised_stops() -> None:
    """n=1, temperature 1, 16 tokens; a single stop string becomes a tuple."""
    params = SamplingParams(stop="END", stop_token_ids=[7])  # type: ignore[arg-type]
    assert (params.n, params.temperature, params.max_tokens) == (1, 1.0, 16)
    assert (params.stop, params.stop_token_ids) == (("END",), (7,))
    assert not params.is_greedy and not params.uses_penalties
    assert SamplingParams(temperature=0).is_greedy
    assert SamplingParams(presence_penalty=0.5).uses_penalties


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"n": 0}, "n must be at least 1, got 0"),
        ({"temperature": -0.1}, "temperature must be non-negative, got -0.1"),
        ({"top_p": 0.0}, "top_p must be in (0, 1], got 0.0"),
        ({"top_k": -2}, "top_k must be -1 (disable), 0 (disable) or positive, got -2"),
        ({"min_p": 1.5}, "min_p must be in [0, 1], got 1.5"),
        ({"repetition_penalty": 0.0}, "repetition_penalty must be positive, got 0.0"),
        ({"presence_penalty": 3.0}, "presence_penalty must be in [-2, 2], got 3.0"),
        ({"frequency_penalty": -3.0}, "frequency_penalty must be in [-2, 2], got -3.0"),
        ({"max_tokens": 0}, "max_tokens must be at least 1, got 0"),
        ({"min_tokens": -1}, "min_tokens must be non-negative, got -1"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens (5) must not exceed max_tokens (4)"),
        ({"logprobs": -2}, "logprobs must be non-negative, got -2"),
        ({"prompt_logprobs": -1}, "prompt_logprobs must be non-negative, got -1"),
        ({"stop": ["ok", ""]}, "stop strings must be non-empty"),
        ({"temperature": float("nan")}, "temperature must be a finite number, got nan"),
        ({"temperature": float("inf")}, "temperature must be a finite number, got inf"),
        (
            {"repetition_penalty": float("nan")},
            "repetition_penalty must be a finite number, got nan",
        ),
        (
            {"seed": 2**64},
            f"seed must be in [{-(2**63)}, {2**64 - 1}] for n=1 (each sample draws with seed + "
            f"its index), got {2**64}",
        ),
        (
            {"seed": 2**64 - 1, "n": 2},
            f"seed must be in [{-(2**63)}, {2**64 - 2}] for n=2 (each sample draws with seed + "
            f"its index), got {2**64 - 1}",
        ),
    ],
)
def test_each_bad_value_is_a_request_error(kwargs: dict[str, object], message: str) -> None:
    """Out-of-range values raise InvalidRequestError with the exact reason."""
    with pytest.raises(InvalidRequestError) as refused:
        SamplingParams(**kwargs)  # type: ignore[arg-type]
    assert str(refused.value) == message


def test_every_accepted_seed_is_one_the_generator_takes() -> None:
    """At both ends of the range, every sample's seed (seed + index) seeds a torch generator."""
    import torch

    for params in (
        SamplingParams(seed=2**64 - 3, n=3),
        SamplingParams(seed=-(2**63), n=2),
    ):
        assert params.seed is not None
        for index in range(params.n):
            generator = torch.Generator().manual_seed(params.seed + index)
            assert generator.initial_seed() == (params.seed + index) % 2**64
