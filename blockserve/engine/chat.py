"""A conversation to prompt token ids through the model's chat template, without role injection."""

from __future__ import annotations

import secrets
from collections.abc import Callable, Sequence
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


IMAGE_PLACEHOLDER = "<image>"  # what a vision-language chat template writes for an image part


def image_chat_prompt_ids(
    tokenizer: Any,
    messages: Sequence[dict[str, Any]],
    add_generation_prompt: bool,
    special_tokens_in_content: bool,
    tools: Sequence[dict[str, Any]] | None,
    image_ids: Callable[[int, int], Sequence[int]],
) -> list[int]:
    """The prompt token ids of a conversation whose contents may be lists of text and image
    parts (`{"type": "text", "text": ...}`, `{"type": "image"}`), the template writing
    `<image>` for each image part; `image_ids(index, offset)` gives the image's tokens at the
    prompt position `offset`. Text parts stay plain text, as in `chat_prompt_ids`: where none
    holds special-token text the rendered text is tokenized as a whole (every image a special
    token boundary), else the template's text and the parts apart."""
    texts = [_part_texts(m.get("content")) for m in messages]
    specials = special_token_texts(tokenizer)
    flat = [text for parts in texts for text in parts]
    images = sum(
        1 for m in messages for part in _parts(m.get("content")) if part["type"] == "image"
    )
    if special_tokens_in_content or not any(s in t for t in flat for s in specials):
        rendered = _render(
            tokenizer, [_for_template(m) for m in messages], add_generation_prompt, tools
        )
        pieces, flat = [rendered], []
    else:
        pieces = _marked_pieces(tokenizer, messages, add_generation_prompt, tools, flat)
    written = sum(piece.count(IMAGE_PLACEHOLDER) for piece in pieces)
    if written != images:
        raise InvalidRequestError(
            f"the chat template wrote {written} image placeholders for {images} images",
            "messages",
        )
    ids: list[int] = []
    placed = 0
    for piece, text in zip(pieces, [*flat, ""], strict=True):
        for index, segment in enumerate(piece.split(IMAGE_PLACEHOLDER)):
            if index:
                ids += image_ids(placed, len(ids))
                placed += 1
            ids += tokenizer.encode(segment, add_special_tokens=False)
        ids += tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True)
    return ids


def _parts(content: Any) -> list[dict[str, Any]]:
    if isinstance(content, list):
        return content
    return [{"type": "text", "text": content or ""}]


def _part_texts(content: Any) -> list[str]:
    return [part["text"] for part in _parts(content) if part["type"] == "text"]


def _for_template(message: dict[str, Any]) -> dict[str, Any]:
    """A message as a vision-language template reads it: image parts as `{"type": "image"}`."""
    content = message.get("content")
    if not isinstance(content, list):
        return message
    parts = [
        {"type": "image"} if part["type"] == "image" else {"type": "text", "text": part["text"]}
        for part in content
    ]
    return {**message, "content": parts}


def _marked_pieces(
    tokenizer: Any,
    messages: Sequence[dict[str, Any]],
    add_generation_prompt: bool,
    tools: Sequence[dict[str, Any]] | None,
    texts: list[str],
) -> list[str]:
    """The template's text around each text part (rendered with a unique marker for each),
    as `_template_pieces` finds it for string contents."""
    nonce = secrets.token_hex(8)
    markers = iter(f"\x00{nonce}:{i}\x00" for i in range(len(texts)))
    marked = []
    for message in messages:
        parts = [
            {"type": "image"}
            if part["type"] == "image"
            else {"type": "text", "text": next(markers)}
            for part in _parts(message.get("content"))
        ]
        content: Any = parts if isinstance(message.get("content"), list) else parts[0]["text"]
        marked.append({**message, "content": content})
    rendered = _render(tokenizer, marked, add_generation_prompt, tools)
    pieces = []
    rest = rendered
    for i in range(len(texts)):
        head, found, rest = rest.partition(f"\x00{nonce}:{i}\x00")
        if not found:
            raise InvalidRequestError(
                "a message holds special-token text, and this chat template rewrites message "
                "content, so it cannot be kept as plain text",
                "messages",
            )
        pieces.append(head)
    pieces.append(rest)
    return pieces
