"""Incremental detokenization with stop strings. Owns one sample's text: decodes new tokens without
re-decoding the whole output, finds stop strings even when they span token boundaries, and holds
back the tail that could still become a stop string so a stream never shows text that is later
cut."""

from __future__ import annotations

from typing import Any

from blockserve.sampling_params import SamplingParams

# Prompt tokens decoded as left context of the first output tokens: some tokenizers drop
# a token's leading space when it is decoded alone.
_PROMPT_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text, one step at a time."""

    def __init__(self, tokenizer: Any, params: SamplingParams, prompt_token_ids: list[int]) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = params.skip_special_tokens
        self.stop = params.stop
        self.include_stop = params.include_stop_str_in_output
        self.max_stop_len = max((len(s) for s in self.stop), default=0)
        self.token_ids: list[int] = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        self._text = ""
        self.prefix_offset = 0  # decoding starts here, for context
        self.read_offset = len(self.token_ids)  # tokens before this are already in `text`
        self.stop_reason: str | None = None

    def _decode(self, token_ids: list[int]) -> str:
        return str(self.tokenizer.decode(token_ids, skip_special_tokens=self.skip_special_tokens))

    @property
    def text(self) -> str:
        """The text of the tokens so far (those of an incomplete character wait)."""
        if not self.stop and self.read_offset < len(self.token_ids):
            self._decode_new()
        return self._text

    def update(self, new_token_ids: list[int]) -> str | None:
        """Add tokens; return the stop string if one now appears (the text is then cut).
        Without stop strings nothing can stop, so decoding waits until the text is read: a
        caller that reads it only at the end (the offline API) decodes once."""
        self.token_ids.extend(new_token_ids)
        return self._decode_new() if self.stop else None

    def _decode_new(self) -> str | None:
        """Decode the tokens past `read_offset` onto the text; the stop string it now holds,
        if any."""
        prefix_text = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        full_text = self._decode(self.token_ids[self.prefix_offset :])
        # A trailing U+FFFD means an incomplete multi-byte character: wait for more tokens.
        if len(full_text) <= len(prefix_text) or full_text.endswith("\ufffd"):
            return None
        new_text = full_text[len(prefix_text) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        previous_len = len(self._text)
        self._text += new_text
        return self._check_stop(previous_len)

    def _check_stop(self, previous_len: int) -> str | None:
        if not self.stop:
            return None
        # Only text that could contain a stop string ending in the new text is searched.
        start = max(previous_len - self.max_stop_len + 1, 0)
        best: tuple[int, str] | None = None
        for stop in self.stop:
            index = self._text.find(stop, start)
            if index != -1 and (best is None or index < best[0]):
                best = (index, stop)
        if best is None:
            return None
        index, stop = best
        self._text = self._text[: index + len(stop)] if self.include_stop else self._text[:index]
        self.stop_reason = stop
        return stop

    def visible_text(self, finished: bool) -> str:
        """The text safe to show now: while running, the tail that might begin a stop
        string is held back."""
        if finished or not self.stop:
            return self.text
        return self.text[: max(len(self.text) - self.max_stop_len + 1, 0)]
