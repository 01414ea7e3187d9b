"""Response bodies from engine outputs: usage with cached tokens, SSE framing, logprobs, and
the per-choice deltas a stream sends."""

from __future__ import annotations

from blockserve.engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from blockserve.server.responses import (
    ChoiceTracker,
    TokenText,
    chat_logprobs,
    completion_logprobs,
    sse,
    usage,
)


class CharTokenizer:
    def decode(self, token_ids: list[int]) -> str:
        return "".join(chr(t) for t in token_ids)


def output(prompt_len: int, cached: int, *token_counts: int) -> RequestOutput:
    return RequestOutput(
        request_id="r",
        prompt=None,
        prompt_token_ids=tuple(range(prompt_len)),
        num_cached_tokens=cached,
        outputs=tuple(
            CompletionOutput(index=i, text="", token_ids=tuple(range(n)))
            for i, n in enumerate(token_counts)
        ),
        finished=True,
        metrics=RequestMetrics(0.0),
    )


def test_usage_sums_prompts_choices_and_cached_tokens() -> None:
    """Two prompts, three choices: totals add up; cached_tokens is always present."""
    assert usage([output(33, 32, 4, 5), output(10, 0, 2)]) == {
        "prompt_tokens": 43,
        "completion_tokens": 11,
        "total_tokens": 54,
        "prompt_tokens_details": {"cached_tokens": 32},
    }
    assert usage([output(3, 0, 1)])["prompt_tokens_details"] == {"cached_tokens": 0}


def test_sse_frames_json_and_done() -> None:
    """One `data:` line and a blank line per event; non-ASCII text stays as it is."""
    assert sse({"text": "é"}) == 'data: {"text": "é"}\n\n'
    assert sse("[DONE]") == "data: [DONE]\n\n"


def test_logprob_objects() -> None:
    """Completions: parallel lists with text offsets; chat: entries with bytes and top-N."""
    text = TokenText(CharTokenizer())
    logprobs = [Logprob(104, -0.5, 1, {104: -0.5, 105: -1.5}), Logprob(105, -0.25, 1, {})]
    assert completion_logprobs(logprobs, text, 10) == {
        "tokens": ["h", "i"],
        "token_logprobs": [-0.5, -0.25],
        "top_logprobs": [{"h": -0.5, "i": -1.5}, {}],
        "text_offset": [10, 11],
    }
    (first, _) = chat_logprobs(logprobs, text)["content"]
    assert first == {
        "token": "h",
        "logprob": -0.5,
        "bytes": [104],
        "top_logprobs": [
            {"token": "h", "logprob": -0.5, "bytes": [104]},
            {"token": "i", "logprob": -1.5, "bytes": [105]},
        ],
    }


def test_tracker_sends_only_what_is_new() -> None:
    """Each delta carries the new text and token range; nothing new gives None; the finish
    is sent once; the role is taken once per choice."""
    tracker = ChoiceTracker()
    grow = [
        CompletionOutput(0, "He", (1, 2)),
        CompletionOutput(0, "He", (1, 2, 3)),  # a token with no visible text yet
        CompletionOutput(0, "Hello", (1, 2, 3, 4), finish_reason="stop"),
    ]
    deltas = [tracker.delta(0, choice) for choice in grow]
    assert deltas == [("He", 0, 2, False), None, ("llo", 2, 4, True)]
    assert tracker.delta(0, grow[-1]) is None
    assert [tracker.take_role(0), tracker.take_role(0), tracker.take_role(1)] == [True, False, True]
    every = ChoiceTracker(every_token=True)
    every.delta(0, grow[0])
    assert every.delta(0, grow[1]) == ("", 2, 3, False)
