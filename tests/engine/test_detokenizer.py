"""Incremental detokenization and stop strings, on a real byte-level BPE tokenizer."""

from __future__ import annotations

import pytest

from blockserve.engine.detokenizer import IncrementalDetokenizer
from blockserve.sampling_params import SamplingParams
from tests.tiny_models import make_tokenizer

TOKENIZER = make_tokenizer()


def feed(text: str, params: SamplingParams) -> tuple[IncrementalDetokenizer, list[str | None]]:
    """Feed `text` token by token, stopping at a stop string as the engine does."""
    detok = IncrementalDetokenizer(TOKENIZER, params, prompt_token_ids=[5, 6])
    results: list[str | None] = []
    for token in TOKENIZER.encode(text):
        results.append(detok.update([token]))
        if results[-1] is not None:
            break
    return detok, results


def test_incremental_text_equals_full_decode() -> None:
    """Token by token, the text equals decoding all tokens at once, multi-byte chars included."""
    text = "hello wörld — blocks ✓ cached"
    detok, _ = feed(text, SamplingParams())
    assert detok.text == text


def test_without_stop_strings_decoding_waits_until_the_text_is_read() -> None:
    """No stop string: updates only collect tokens, and reading the text once at the end
    decodes them in one go (two tokenizer calls), to what decoding them all at once gives,
    as reading it after every token does."""
    text = "hello wörld — blocks ✓ cached"
    calls = []

    class Counting:
        def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
            calls.append(len(token_ids))
            return str(TOKENIZER.decode(token_ids, skip_special_tokens=skip_special_tokens))

    tokens = TOKENIZER.encode(text)
    lazy = IncrementalDetokenizer(Counting(), SamplingParams(), prompt_token_ids=[5, 6])
    assert all(lazy.update([token]) is None for token in tokens) and calls == []
    assert lazy.visible_text(True) == text and len(calls) == 2
    assert lazy.text == text and len(calls) == 2  # nothing new: no decoding
    eager = IncrementalDetokenizer(TOKENIZER, SamplingParams(), prompt_token_ids=[5, 6])
    read = []
    for token in tokens:
        eager.update([token])
        read.append(eager.text)
    assert read[-1] == text and all(text.startswith(r) for r in read)


def test_stop_string_spanning_tokens_is_found_and_cut() -> None:
    """A stop string split across tokens ends the text before it."""
    text = "the quick brown fox jumps"
    tokens = TOKENIZER.encode(text)
    assert len(tokens) > 3
    detok, results = feed(text, SamplingParams(stop=("k brow",)))
    assert [r for r in results if r is not None] == ["k brow"]
    assert detok.text == "the quic"
    assert detok.stop_reason == "k brow"


def test_include_stop_str_in_output() -> None:
    """include_stop_str_in_output keeps the stop string and cuts after it."""
    detok, _ = feed(
        "the quick brown fox", SamplingParams(stop=("quick",), include_stop_str_in_output=True)
    )
    assert detok.text == "the quick"


def test_earliest_stop_string_wins() -> None:
    """With several stop strings the earliest occurrence ends the text."""
    detok, _ = feed("what is the capital", SamplingParams(stop=("capital", "is")))
    assert detok.text == "what "
    assert detok.stop_reason == "is"


@pytest.mark.parametrize(("finished", "expected"), [(False, "hello wor"), (True, "hello world")])
def test_visible_text_holds_back_a_possible_stop_prefix(finished: bool, expected: str) -> None:
    """While running, the last len(stop)-1 characters are held back from streams."""
    detok, _ = feed("hello world", SamplingParams(stop=("ldx",)))
    assert detok.visible_text(finished) == expected
