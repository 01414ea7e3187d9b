"""Request types: prompt shapes normalised once, specs frozen, sample ids structured."""

from __future__ import annotations

import dataclasses

import pytest

from blockserve.engine.request import RequestSpec, SampleId, as_prompt_list
from blockserve.errors import InvalidRequestError


@pytest.mark.parametrize(
    ("prompts", "expected"),
    [
        ("hi", ["hi"]),
        ([1, 2, 3], [(1, 2, 3)]),
        (["a", "b"], ["a", "b"]),
        ([[1, 2], [3]], [(1, 2), (3,)]),
        (["a", [4, 5]], ["a", (4, 5)]),
        ({"prompt": "hi"}, ["hi"]),
        ({"prompt_token_ids": [1, 2]}, [(1, 2)]),
        ([{"prompt_token_ids": [7]}, {"prompt": "b"}, [8]], [(7,), "b", (8,)]),
    ],
)
def test_prompt_shapes(prompts: object, expected: list[object]) -> None:
    """A string, token ids, vLLM's prompt dicts, or a list of any: one prompt per entry,
    token ids as tuples."""
    assert as_prompt_list(prompts) == expected  # type: ignore[arg-type]


def test_an_empty_prompt_list_is_refused() -> None:
    """No prompt at all is a request error on the prompt field."""
    with pytest.raises(InvalidRequestError, match="prompt must not be empty") as refused:
        as_prompt_list([])
    assert refused.value.param == "prompt"


@pytest.mark.parametrize(
    ("prompts", "message"),
    [
        ({"prompt_token_ids": [1], "prompt": "a"}, r"keys \['prompt', 'prompt_token_ids'\]"),
        ([{"text": "a"}], r"got the keys \['text'\]"),
        ({"prompt": [1, 2]}, r"got the keys \['prompt'\]"),
        (["a", 3], "got int"),
    ],
)
def test_other_prompt_shapes_are_refused(prompts: object, message: str) -> None:
    """A dict with other keys (or both), or an entry that is no prompt, is a request error on
    the prompt field, before anything is queued."""
    with pytest.raises(InvalidRequestError, match=message) as refused:
        as_prompt_list(prompts)  # type: ignore[arg-type]
    assert refused.value.param == "prompt"


def test_spec_is_frozen_and_keeps_token_ids_as_a_tuple() -> None:
    """A list of token ids becomes a tuple, so the spec cannot change after validation."""
    spec = RequestSpec("r", [1, 2])  # type: ignore[arg-type]
    assert spec.prompt == (1, 2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.priority = 3  # type: ignore[misc]


def test_sample_ids_of_different_requests_never_collide() -> None:
    """Sample 1 of "y" and sample 0 of "1_y" are different keys (a string id could collide)."""
    assert SampleId("y", 1) != SampleId("1_y", 0)
    assert len({SampleId("y", 1), SampleId("1_y", 0), SampleId("y", 0)}) == 3
    assert sorted([SampleId("b", 0), SampleId("a", 1), SampleId("a", 0)]) == [
        SampleId("a", 0),
        SampleId("a", 1),
        SampleId("b", 0),
    ]
