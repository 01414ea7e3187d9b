"""A conversation to prompt token ids through the model's chat template, without role injection."""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from typing import Any

from blockserve.errors import InvalidRequestError

# A chat template writes each message's content between the special tokens that mark turns
# (`<|im_start|>user\n ... <|im_end|>`). Tokenizing the rendered text as one string would turn
# special-token text *inside* a message into real special tokens, so a user could close their turn
# and forge a system message. Here the content stays plain text: the template's own text is
# tokenized with special tokens, each message's content with them split into ordinary pieces.
#
# A conversation whose contents hold no special-token text (nearly all) is tokenized as one
# string, exactly as before, so its prompt (and the cached blocks it hits) do not change.

Message = dict[str, str]


def chat_prompt_ids(
    tokenizer: Any,
    messages: Sequence[Message],
    add_generation_prompt: bool = True,
    special_tokens_in_content: bool = False,
    tools: Sequence[dict[str, Any]] | None = None,
) -> list[int]:
    """The prompt token ids of `messages` under the tokenizer's chat template, which is
    given `tools` (OpenAI's shape) to render if it knows how.

    Special-token text inside a message's content is tokenized as plain text unless
    `special_tokens_in_content` (for trusted callers only). InvalidRequestError if the
    template fails on the conversation.
    """
    text = _render(tokenizer, messages, add_generation_prompt, tools)
    contents = [m.get("content") or "" for m in messages]
    specials = special_token_texts(tokenizer)
    if special_tokens_in_content or not any(s in c for c in contents for s in specials):
        return list(tokenizer.encode(text, add_special_tokens=False))
    pieces = _template_pieces(tokenizer, messages, contents, add_generation_prompt, text, tools)
    ids: list[int] = []
    for piece, content in zip(pieces, [*contents, ""], strict=True):
        ids += tokenizer.encode(piece, add_special_tokens=False)
        ids += tokenizer.encode(content, add_special_tokens=False, split_special_tokens=True)
    return ids


def special_token_texts(tokenizer: Any) -> frozenset[str]:
    """The text of every special token the tokenizer would parse out of a string."""
    return frozenset(t.content for t in tokenizer.added_tokens_decoder.values() if t.special)


def _render(
    tokenizer: Any,
    messages: Sequence[Message],
    add_generation_prompt: bool,
    tools: Sequence[dict[str, Any]] | None,
) -> str:
    try:
        return str(
            tokenizer.apply_chat_template(
                list(messages),
                tools=list(tools) if tools else None,
                add_generation_prompt=add_generation_prompt,
                tokenize=False,
            )
        )
    except Exception as exc:  # a template error is the request's fault
        raise InvalidRequestError(f"the chat template failed: {exc}", "messages") from exc


def _template_pieces(
    tokenizer: Any,
    messages: Sequence[Message],
    contents: list[str],
    add_generation_prompt: bool,
    text: str,
    tools: Sequence[dict[str, Any]] | None,
) -> list[str]:
    """The template's own text around the contents: `text` is pieces[0] + content 0 +
    pieces[1] + ... + pieces[-1]. Found by rendering with a unique marker for each content;
    a template that changes content as it writes it (trims it, say) cannot be split so, and
    its conversation is refused rather than tokenized unsafely."""
    nonce = secrets.token_hex(8)
    markers = [f"\x00{nonce}:{i}\x00" for i in range(len(messages))]
    marked = _render(
        tokenizer,
        [{**m, "content": marker} for m, marker in zip(messages, markers, strict=True)],
        add_generation_prompt,
        tools,
    )
    pieces = []
    rest = marked
    for marker in markers:
        head, found, rest = rest.partition(marker)
        if not found:
            break
        pieces.append(head)
    pieces.append(rest)
    if len(pieces) != len(messages) + 1 or text != "".join(
        p + c for p, c in zip(pieces, [*contents, ""], strict=True)
    ):
        raise InvalidRequestError(
            "a message holds special-token text, and this chat template rewrites message "
            "content, so it cannot be kept as plain text",
            "messages",
        )
    return pieces
