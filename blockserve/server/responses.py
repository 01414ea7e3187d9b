"""Turning engine outputs into OpenAI response bodies and SSE chunks.

Pure functions of `RequestOutput`s: no I/O. A `ChoiceTracker` remembers, per choice, how much
text and how many tokens a stream has already sent, so each chunk carries only the delta.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from blockserve.engine.outputs import CompletionOutput, Logprob, RequestOutput


def usage(outputs: Sequence[RequestOutput]) -> dict[str, Any]:
    """OpenAI usage, with `prompt_tokens_details.cached_tokens` always present (and split
    into `cached_tokens_per_tier` when a tier below the device served some), and
    `cache_explanation` when the request asked: an object for one prompt, a list in prompt
    order for several."""
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    completion_tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    body: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": sum(o.num_cached_tokens for o in outputs)},
    }
    if any(o.tier_cached_tokens for o in outputs):
        per_tier = {"device": 0, "host": 0, "disk": 0}
        for output in outputs:
            below = output.tier_cached_tokens
            per_tier["device"] += output.num_cached_tokens - sum(below.values())
            for tier, count in below.items():  # "remote" only where that tier served some
                per_tier[tier] = per_tier.get(tier, 0) + count
        body["prompt_tokens_details"]["cached_tokens_per_tier"] = per_tier
    explanations = [asdict(o.cache_explanation) for o in outputs if o.cache_explanation is not None]
    if explanations:
        body["cache_explanation"] = explanations[0] if len(outputs) == 1 else explanations
    return body


def sse(payload: dict[str, Any] | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n"


class TokenText:
    """Token id → its text, for logprobs (decoded with the server's own tokenizer), each id
    decoded once per response: a scored prompt names the same tokens thousands of times."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._texts: dict[int, str] = {}  # at most the vocabulary

    def __call__(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = str(self.tokenizer.decode([token_id]))
        return text

    def decode(self, ids: Sequence[int]) -> str:
        """The text of a sequence of ids (an echoed token-id prompt)."""
        return str(self.tokenizer.decode(list(ids)))


def completion_logprobs(
    logprobs: Sequence[Logprob | None],
    token_text: TokenText,
    text_offset: int,
    token_ids: Sequence[int] | None = None,
) -> dict[str, Any]:
    """The legacy completions logprobs object: parallel lists per token. An echoed prompt's
    first token has no logprob (None, as `token_ids` names it)."""
    ids = token_ids if token_ids is not None else [lp.token_id for lp in logprobs if lp]
    tokens = [token_text(token_id) for token_id in ids]
    offsets = []
    for token in tokens:
        offsets.append(text_offset)
        text_offset += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": [None if lp is None else lp.logprob for lp in logprobs],
        "top_logprobs": [
            None if lp is None else {token_text(t): value for t, value in lp.top.items()}
            for lp in logprobs
        ],
        "text_offset": offsets,
    }


def prompt_logprobs_json(
    logprobs: Sequence[Logprob | None] | None, token_text: TokenText
) -> list[dict[str, dict[str, Any]] | None] | None:
    """vLLM's `prompt_logprobs`: per prompt token, None for the first, else {token id: its
    logprob, rank and text} for the token and its top alternatives (-inf as -9999.0)."""
    if logprobs is None:
        return None

    def entry(token_id: int, value: float, rank: int | None) -> dict[str, Any]:
        logprob = max(value, -9999.0)
        return {"logprob": logprob, "rank": rank, "decoded_token": token_text(token_id)}

    out: list[dict[str, dict[str, Any]] | None] = []
    for lp in logprobs:
        if lp is None:
            out.append(None)
            continue
        ranked = sorted(lp.top.items(), key=lambda item: -item[1])
        position = {str(t): entry(t, v, rank) for rank, (t, v) in enumerate(ranked, start=1)}
        position[str(lp.token_id)] = entry(lp.token_id, lp.logprob, lp.rank)
        out.append(position)
    return out


def chat_logprobs(logprobs: Sequence[Logprob], token_text: TokenText) -> dict[str, Any]:
    """The chat logprobs object: one entry per token with its top alternatives."""

    def entry(token_id: int, value: float) -> dict[str, Any]:
        text = token_text(token_id)
        return {"token": text, "logprob": value, "bytes": list(text.encode())}

    return {
        "content": [
            {
                **entry(lp.token_id, lp.logprob),
                "top_logprobs": [entry(t, v) for t, v in lp.top.items()],
            }
            for lp in logprobs
        ]
    }


@dataclass
class _Sent:
    text: int = 0
    tokens: int = 0
    finished: bool = False
    role_sent: bool = False


@dataclass
class ChoiceTracker:
    """What a stream has sent so far, per choice index.

    A chunk goes out when there is new text, or when the choice finishes; with `every_token`
    (the client asked for token ids) also for tokens whose text is not visible yet.
    """

    every_token: bool = False
    sent: dict[int, _Sent] = field(default_factory=dict)

    def delta(self, index: int, choice: CompletionOutput) -> tuple[str, int, int, bool] | None:
        """(new text, first new token, end token, finished now) or None when nothing is new."""
        state = self.sent.setdefault(index, _Sent())
        if state.finished:
            return None
        text = choice.text[state.text :]
        first, end = state.tokens, len(choice.token_ids)
        finished_now = choice.finish_reason is not None
        if not text and not finished_now and not (self.every_token and end > first):
            return None  # tokens without visible text yet ride along with the next chunk
        state.text, state.tokens, state.finished = len(choice.text), end, finished_now
        return text, first, end, finished_now

    def take_role(self, index: int) -> bool:
        """True the first time it is asked for a choice (chat sends the role once)."""
        state = self.sent.setdefault(index, _Sent())
        first, state.role_sent = not state.role_sent, True
        return first
