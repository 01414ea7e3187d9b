"""`InputProcessor`: the one place a request is checked and tokenized."""

from __future__ import annotations

from collections.abc import Container, Sequence
from dataclasses import dataclass
from typing import Any

from PIL import Image

from blockserve.engine.chat import Message, chat_prompt_ids, image_chat_prompt_ids
from blockserve.engine.request import ImagesPrompt, RequestSpec, ValidatedRequest
from blockserve.errors import InvalidRequestError, ModelNotFoundError
from blockserve.grammar import GrammarCompiler
from blockserve.model.tokenizer import Tokenizer
from blockserve.multimodal.hasher import EncodedImage
from blockserve.multimodal.inputs import ImageInput
from blockserve.multimodal.media import load_image_url
from blockserve.multimodal.prompts import ImagePrompts


@dataclass(frozen=True)
class InputProcessor:
    """Checks specs against one engine's limits: its vocabulary, context and policy.

    Every rule a request must meet lives here (prompt and token range, context length, priority
    under the policy, salt, unsupported features, duplicate id); the output processor, the
    engine core and the scheduler below trust what passes. A refusal raises InvalidRequestError
    naming the field and changes nothing. Any thread may call it: its tokenizer serves many at
    once.
    """

    tokenizer: Tokenizer
    vocab_size: int
    max_model_len: int
    scheduling_policy: str
    max_n: int
    # UTF-8 bytes of the longest token's string: a prompt of b bytes has at least
    # ceil(b / max_bytes_per_token) tokens, which bounds it before any tokenizing.
    max_bytes_per_token: int | None = None
    # The most logprobs (and prompt logprobs) a request may ask for (--max-logprobs).
    max_logprobs: int = 20
    # Compiles structured-outputs constraints (thread-safe, as the tokenizer is); a
    # constraint that does not compile is refused here, before the request is queued.
    grammar: GrammarCompiler | None = None
    # The adapters a request may name (--enable-lora's registered ones); None: LoRA is off.
    lora_names: Container[str] | None = None
    # How a prompt's images become tokens (a vision-language model's); None: text only.
    images: ImagePrompts | None = None

    def process(self, spec: RequestSpec, live_request_ids: Container[str]) -> ValidatedRequest:
        """The spec, checked and tokenized; InvalidRequestError for the first field at fault."""
        self.check_request_id(spec.request_id, live_request_ids)
        self._check_options(spec)
        self._check_vocabulary_bounds(spec)
        images: tuple[ImageInput, ...] = spec.images  # a chat's, rendered with its prompt
        if isinstance(spec.prompt, ImagesPrompt):
            token_ids, images = self._with_images(spec.prompt)
        else:
            token_ids = self._token_ids(spec.prompt)
        if len(token_ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"the prompt has {len(token_ids)} tokens, but the context is "
                f"{self.max_model_len} tokens and one must be left to generate",
                "prompt",
            )
        max_tokens = spec.params.max_tokens
        if max_tokens is not None and len(token_ids) + max_tokens > self.max_model_len:
            # Refused rather than silently cut short at the context's end (vLLM does the same).
            raise InvalidRequestError(
                f"the context is {self.max_model_len} tokens, but {len(token_ids)} prompt "
                f"tokens and max_tokens {max_tokens} ask for {len(token_ids) + max_tokens}; "
                "shorten the prompt or lower max_tokens",
                "max_tokens",
            )
        return ValidatedRequest(spec, token_ids, images)

    def check_request_id(self, request_id: str, live_request_ids: Container[str]) -> None:
        if request_id in live_request_ids:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", "request_id")

    def encode_text(self, text: str, add_special_tokens: bool = True) -> tuple[int, ...]:
        """A text prompt's token ids. Text that cannot fit the context whatever its tokens
        are, or that no tokenizer can take (a lone surrogate), is refused before any
        tokenizing."""
        self._check_bytes(text)
        if not text.isascii():
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise InvalidRequestError(
                    f"the prompt is not valid Unicode: {exc.reason} at {exc.start}", "prompt"
                ) from None
        return tuple(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def chat_prompt(
        self,
        messages: Sequence[Message],
        add_generation_prompt: bool = True,
        special_tokens_in_content: bool = False,
        tools: Sequence[dict[str, Any]] | None = None,
    ) -> tuple[int, ...]:
        """A conversation's prompt token ids under the model's chat template (engine/chat.py:
        special-token text in a message is plain text unless `special_tokens_in_content`).
        A conversation too long for the context is refused before it is tokenized."""
        self._check_bytes(sum(_utf8_length(m.get("content") or "") for m in messages))
        return tuple(
            chat_prompt_ids(
                self.tokenizer, messages, add_generation_prompt, special_tokens_in_content, tools
            )
        )

    def _check_options(self, spec: RequestSpec) -> None:
        if spec.cache_salt is not None and not spec.cache_salt:
            raise InvalidRequestError("cache_salt must be a non-empty string", "cache_salt")
        if spec.lora_name is not None and self.lora_names is None:
            raise InvalidRequestError(
                "LoRA adapters are served with --enable-lora only", "lora_name"
            )
        if spec.lora_name is not None and spec.lora_name not in (self.lora_names or ()):
            # A 404 as for any model name nothing is served under (it may have been unloaded
            # since the server read the name).
            raise ModelNotFoundError(f"The lora adapter '{spec.lora_name}' cannot be found.")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(spec.params, name)
            if value is not None and value > self.max_logprobs:
                raise InvalidRequestError(
                    f"{name} must be at most {self.max_logprobs} (--max-logprobs), got {value}",
                    name,
                )
        constraint = spec.params.structured_outputs
        if constraint is not None:
            # The constraint decides where the output ends (with EOS): ignoring or banning EOS
            # would leave a finished constraint no token to draw.
            for name in ("ignore_eos", "min_tokens"):
                if getattr(spec.params, name):
                    raise InvalidRequestError(
                        f"{name} cannot be combined with structured outputs: the constraint "
                        "decides where the output ends",
                        name,
                    )
            if self.grammar is None:
                raise InvalidRequestError(
                    "structured outputs are not available in this engine", "structured_outputs"
                )
            self.grammar.compile(constraint)
        if spec.params.n > self.max_n:
            raise InvalidRequestError(f"n must be at most {self.max_n}, got {spec.params.n}", "n")
        if spec.priority != 0 and self.scheduling_policy != "priority":
            raise InvalidRequestError(
                "priority is only supported with the priority scheduling policy", "priority"
            )

    def _check_vocabulary_bounds(self, spec: RequestSpec) -> None:
        """Sampling options that index the vocabulary must stay inside it: out of range, they
        would fail the sampler's whole batch, neighbours included."""
        params = spec.params
        if params.top_k > self.vocab_size:
            raise InvalidRequestError(
                f"top_k must be -1, 0 or at most the vocabulary size {self.vocab_size}, "
                f"got {params.top_k}",
                "top_k",
            )
        bad = [t for t in params.stop_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequestError(
                f"stop token id {bad[0]} is out of range for a vocabulary of {self.vocab_size}",
                "stop_token_ids",
            )
        bad = sorted(t for t in params.logit_bias or () if t >= self.vocab_size)
        if bad:
            raise InvalidRequestError(
                f"logit_bias token id {bad[0]} is out of range for a vocabulary of "
                f"{self.vocab_size}",
                "logit_bias",
            )

    def image_chat_prompt(
        self,
        messages: Sequence[dict[str, Any]],
        add_generation_prompt: bool = True,
        special_tokens_in_content: bool = False,
        tools: Sequence[dict[str, Any]] | None = None,
    ) -> tuple[tuple[int, ...], tuple[ImageInput, ...]]:
        """A conversation with image parts (`{"type": "image", "url": "data:..."}`): its
        prompt token ids, each image's tokens where the template places it, and the images as
        the engine takes them. Each image is decoded here, off the event loop; one that cannot
        be (not an image, truncated, too many pixels, not a data: URL) is refused."""
        if self.images is None:
            raise InvalidRequestError("this model takes no images", "messages")
        self._check_bytes(sum(_utf8_length(t) for m in messages for t in _texts(m)))
        parts = [
            part
            for m in messages
            if isinstance(m.get("content"), list)
            for part in m["content"]
            if part["type"] == "image"
        ]
        self.images.check_count(len(parts), "messages")
        decoded = [
            part["image"]
            if "image" in part
            else load_image_url(part["url"], self.images.media, "messages")
            for part in parts
        ]
        if not all(isinstance(image, EncodedImage | Image.Image) for image in decoded):
            raise InvalidRequestError("an image is a PIL image", "messages")
        images = self.images
        items: list[ImageInput] = []

        def encode(text: str, add_special_tokens: bool) -> list[int]:
            return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

        def image_ids(index: int, offset: int) -> Sequence[int]:
            uuid = parts[index].get("uuid")
            replacement, item = images.image_tokens(decoded[index], offset, encode, uuid)
            items.append(item)
            return replacement

        ids = image_chat_prompt_ids(
            self.tokenizer,
            messages,
            add_generation_prompt,
            special_tokens_in_content,
            tools,
            image_ids,
        )
        return tuple(ids), tuple(items)

    def _with_images(self, prompt: ImagesPrompt) -> tuple[tuple[int, ...], tuple[ImageInput, ...]]:
        """A prompt's token ids with its images' in place of each `<image>`, and the images
        as the engine takes them; a model without a vision half, or an image that is not
        one, is refused."""
        if self.images is None:
            raise InvalidRequestError("this model takes no images", "multi_modal_data")
        if not all(isinstance(image, Image.Image) for image in prompt.images):
            raise InvalidRequestError("an image is a PIL image", "multi_modal_data")
        self._check_bytes(prompt.text)

        def encode(text: str, add_special_tokens: bool) -> list[int]:
            return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

        return self.images.expand(prompt.text, prompt.images, encode, prompt.uuids)

    def _token_ids(self, prompt: str | tuple[int, ...]) -> tuple[int, ...]:
        """Token ids of a prompt; token-id prompts are checked against the vocabulary, text
        too long for the context is refused before it is tokenized."""
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("the prompt is empty", "prompt")
            return self.encode_text(prompt)
        if not prompt:
            raise InvalidRequestError("the prompt is empty", "prompt")
        bad = [t for t in prompt if not isinstance(t, int) or not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequestError(
                f"token id {bad[0]!r} is out of range for a vocabulary of {self.vocab_size}",
                "prompt",
            )
        return prompt

    def _check_bytes(self, text_or_bytes: int | str) -> None:
        """Tokenizing costs time in proportion to the text: a text that cannot fit the
        context whatever its tokens are is refused without paying it. Bytes, not characters:
        a token covers bytes, and one character may be four of them (or an emoji sequence
        many more)."""
        if self.max_bytes_per_token is None:
            return
        size = text_or_bytes if isinstance(text_or_bytes, int) else _utf8_length(text_or_bytes)
        min_tokens = -(-size // self.max_bytes_per_token)
        if min_tokens >= self.max_model_len:
            raise InvalidRequestError(
                f"the prompt has {size} bytes of UTF-8, so at least {min_tokens} tokens "
                f"(no token covers more than {self.max_bytes_per_token} bytes), but the "
                f"context is {self.max_model_len} tokens",
                "prompt",
            )


def _utf8_length(text: str) -> int:
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))


def longest_token_bytes(tokenizer: Any, vocab_size: int) -> int:
    """The UTF-8 length of the longest token string in the vocabulary. A token string spells
    the bytes it covers (byte-level BPE: one character, of 1-2 UTF-8 bytes, a byte; byte
    fallback: `<0xE4>` for one) or its text (sentencepiece: `▁` for a space), never in fewer
    UTF-8 bytes than the text it decodes to, so this bounds the bytes one token covers."""
    tokens = tokenizer.convert_ids_to_tokens(list(range(vocab_size)))
    return max((len(t.encode("utf-8")) for t in tokens if t is not None), default=1)


def _texts(message: dict[str, Any]) -> list[str]:
    content = message.get("content")
    if isinstance(content, list):
        return [part.get("text", "") for part in content if part["type"] == "text"]
    return [content or ""]
