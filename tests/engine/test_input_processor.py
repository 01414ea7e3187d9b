"""The input processor: every request rule in one place, one typed error per bad field."""

from __future__ import annotations

import pytest
from PIL import Image

from blockserve.engine.input_processor import InputProcessor, longest_token_bytes
from blockserve.engine.request import (
    ImagesPrompt,
    RequestSpec,
    ValidatedRequest,
    as_prompt_list,
    as_prompts,
)
from blockserve.errors import InvalidRequestError
from blockserve.multimodal.hasher import item_identifier
from blockserve.multimodal.idefics3 import Idefics3Processing, image_prompt
from blockserve.multimodal.prompts import ImagePrompts
from blockserve.sampling_params import SamplingParams


class CharTokenizer:
    """One token per character: its code point."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) for c in text]


def make_processor(policy: str = "fcfs") -> InputProcessor:
    return InputProcessor(
        CharTokenizer(), vocab_size=1000, max_model_len=32, scheduling_policy=policy, max_n=4
    )


def test_a_good_spec_is_tokenized() -> None:
    """Text is encoded, token ids pass through; the spec rides along unchanged."""
    spec = RequestSpec("a", "hi!")
    assert make_processor().process(spec, set()) == ValidatedRequest(spec, (104, 105, 33))
    ids = RequestSpec("b", [5, 6, 7])  # type: ignore[arg-type]
    assert make_processor().process(ids, set()).prompt_token_ids == (5, 6, 7)


@pytest.mark.parametrize(
    ("spec", "param", "message"),
    [
        (RequestSpec("live", "hi"), "request_id", "request id 'live' is already in use"),
        (
            RequestSpec("a", "hi", cache_salt=""),
            "cache_salt",
            "cache_salt must be a non-empty string",
        ),
        (
            RequestSpec("a", "hi", lora_name="sql"),
            "lora_name",
            "LoRA adapters are served with --enable-lora only",
        ),
        (
            RequestSpec("a", "hi", SamplingParams(logit_bias={1000: 1.0})),
            "logit_bias",
            "logit_bias token id 1000 is out of range for a vocabulary of 1000",
        ),
        (
            RequestSpec("a", "hi", SamplingParams(logprobs=21)),
            "logprobs",
            "logprobs must be at most 20 (--max-logprobs), got 21",
        ),
        (
            RequestSpec("a", "hi", SamplingParams(prompt_logprobs=25)),
            "prompt_logprobs",
            "prompt_logprobs must be at most 20 (--max-logprobs), got 25",
        ),
        (
            RequestSpec("a", "hi", priority=1),
            "priority",
            "priority is only supported with the priority scheduling policy",
        ),
        (
            RequestSpec("a", "hi", SamplingParams(top_k=1001)),
            "top_k",
            "top_k must be -1, 0 or at most the vocabulary size 1000, got 1001",
        ),
        (
            RequestSpec("a", "hi", SamplingParams(stop_token_ids=(3, 1000))),
            "stop_token_ids",
            "stop token id 1000 is out of range for a vocabulary of 1000",
        ),
        (RequestSpec("a", "hi", SamplingParams(n=5)), "n", "n must be at most 4, got 5"),
        (
            RequestSpec("a", "x" * 20, SamplingParams(max_tokens=13)),
            "max_tokens",
            "the context is 32 tokens, but 20 prompt tokens and max_tokens 13 ask for 33; "
            "shorten the prompt or lower max_tokens",
        ),
        (RequestSpec("a", ""), "prompt", "the prompt is empty"),
        (
            RequestSpec("a", "abc \ud800"),
            "prompt",
            "the prompt is not valid Unicode: surrogates not allowed at 4",
        ),
        (RequestSpec("a", ()), "prompt", "the prompt is empty"),
        (
            RequestSpec("a", (1, 1000)),
            "prompt",
            "token id 1000 is out of range for a vocabulary of 1000",
        ),
        (
            RequestSpec("a", "x" * 32),
            "prompt",
            "the prompt has 32 tokens, but the context is 32 tokens and one must be left to "
            "generate",
        ),
    ],
)
def test_each_bad_field_gets_one_error(spec: RequestSpec, param: str, message: str) -> None:
    """A spec bad in one field raises InvalidRequestError naming that field, with the reason."""
    with pytest.raises(InvalidRequestError) as refused:
        make_processor().process(spec, {"live"})
    assert (refused.value.param, str(refused.value)) == (param, message)


def test_priority_is_allowed_under_the_priority_policy() -> None:
    """A non-zero priority passes when the engine schedules by priority."""
    spec = RequestSpec("a", "hi", priority=-3)
    assert make_processor("priority").process(spec, set()).spec.priority == -3


def test_prompt_and_max_tokens_may_fill_the_context_exactly() -> None:
    """31 prompt tokens and 1 to generate, or 20 and 12, fill a 32-token context: accepted;
    with no max_tokens the context's end is the limit."""
    for prompt_len, max_tokens in ((31, 1), (20, 12), (31, None)):
        spec = RequestSpec("a", "x" * prompt_len, SamplingParams(max_tokens=max_tokens))
        assert len(make_processor().process(spec, set()).prompt_token_ids) == prompt_len


class RefusingTokenizer:
    """Fails the test if anything is tokenized."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        raise AssertionError("tokenized")

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str | None]:
        return ["ab", "abcd", None, "x"][: len(ids)]


class SentencePieceLike:
    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return ["\u2581\u00e9", "\u4f60\u597d"][: len(ids)]


def test_text_that_cannot_fit_is_refused_before_tokenizing() -> None:
    """With tokens of at most 4 bytes, 125 bytes are at least 32 tokens: refused without
    tokenizing; 124 bytes might fit, so they are tokenized. Bytes, not characters: 31 emoji
    (4 bytes each) are 124 bytes, 32 are 128."""
    processor = InputProcessor(
        RefusingTokenizer(),
        1000,
        max_model_len=32,
        scheduling_policy="fcfs",
        max_n=4,
        max_bytes_per_token=4,
    )
    with pytest.raises(InvalidRequestError) as refused:
        processor.process(RequestSpec("a", "x" * 125), set())
    assert str(refused.value) == (
        "the prompt has 125 bytes of UTF-8, so at least 32 tokens (no token covers more than "
        "4 bytes), but the context is 32 tokens"
    )
    with pytest.raises(AssertionError, match="tokenized"):
        processor.process(RequestSpec("a", "x" * 124), set())
    with pytest.raises(InvalidRequestError, match="has 128 bytes"):
        processor.process(RequestSpec("a", "\N{GRINNING FACE}" * 32), set())
    with pytest.raises(AssertionError, match="tokenized"):
        processor.process(RequestSpec("a", "\N{GRINNING FACE}" * 31), set())


def test_longest_token_bytes_reads_the_vocabulary() -> None:
    """The bound is the longest token string in UTF-8; ids without a token are skipped."""
    assert longest_token_bytes(RefusingTokenizer(), 4) == 4
    assert longest_token_bytes(SentencePieceLike(), 2) == 6  # "▁é": 3 + 2 bytes, "你好": 6


def test_max_logprobs_bounds_what_a_request_may_ask() -> None:
    """--max-logprobs 30: 30 top logprobs pass, 31 do not (vLLM's flag; its default is 20)."""
    processor = InputProcessor(
        CharTokenizer(), vocab_size=1000, max_model_len=32, scheduling_policy="fcfs", max_n=4,
        max_logprobs=30,
    )  # fmt: skip
    assert processor.process(RequestSpec("a", "hi", SamplingParams(logprobs=30)), set())
    with pytest.raises(InvalidRequestError, match="at most 30 "):
        processor.process(RequestSpec("b", "hi", SamplingParams(logprobs=31)), set())


def small_image() -> Image.Image:
    return Image.new("RGB", (8, 6), (10, 20, 30))


def image_processor(limit: int = 999) -> InputProcessor:
    """A processor whose model takes images: 32-pixel tiles, 4 tokens a tile. Its tokenizer
    spells `<image>` by characters: the tower's tokens take the `>`s."""
    tiles = Idefics3Processing(longest_edge=32, tile=32)
    images = ImagePrompts(tiles, 4, ord(">"), "test/model", "sha256", limit=limit)
    return InputProcessor(
        CharTokenizer(),
        vocab_size=1000,
        max_model_len=512,
        scheduling_policy="fcfs",
        max_n=4,
        images=images,
    )


def test_an_image_prompt_becomes_its_tiles_text_with_its_span() -> None:
    """One 32-pixel tile: the global image alone, 4 image tokens between its markers; the
    span is the whole replacement, the identifier vLLM's for the pixels."""
    image = small_image()
    spec = RequestSpec("a", ImagesPrompt("A<image>B", (image,)))
    validated = image_processor().process(spec, set())
    replacement = image_prompt(0, 0, 4)
    assert validated.prompt_token_ids == tuple(ord(c) for c in f"A{replacement}B")
    (item,) = validated.images
    assert (item.offset, item.length) == (1, len(replacement))
    assert item.embed_positions == tuple(i for i, c in enumerate(replacement) if c == ">")
    assert item.identifier == item_identifier("sha256", "test/model", image)
    assert item.pixel_values.shape == (1, 3, 32, 32)


@pytest.mark.parametrize(
    ("prompt", "message"),
    [
        (
            ImagesPrompt("A<image><image>", (small_image(),)),
            "the prompt has 2 <image> placeholders for 1 images",
        ),
        (ImagesPrompt("A<image>", ("not an image",)), "an image is a PIL image"),
    ],
)
def test_bad_image_prompts_are_refused(prompt: ImagesPrompt, message: str) -> None:
    with pytest.raises(InvalidRequestError) as refused:
        image_processor().process(RequestSpec("a", prompt), set())
    assert (str(refused.value), refused.value.param) == (message, "multi_modal_data")


def test_a_text_model_takes_no_images_and_http_bodies_hold_none() -> None:
    with pytest.raises(InvalidRequestError, match="this model takes no images"):
        make_processor().process(RequestSpec("a", ImagesPrompt("<image>", (small_image(),))), set())
    prompt = {"prompt": "<image>", "multi_modal_data": {"image": small_image()}}
    assert as_prompts(prompt) == [ImagesPrompt("<image>", (small_image(),))]
    with pytest.raises(InvalidRequestError, match="images are given offline only"):
        as_prompt_list(prompt)
    with pytest.raises(InvalidRequestError, match="multi_modal_data holds 'image' alone"):
        as_prompts({"prompt": "x", "multi_modal_data": {"video": 1}})


def test_multi_modal_uuids_stand_for_their_images() -> None:
    """vLLM's offline `multi_modal_uuids`: a uuid is the image's identifier, verbatim; None
    leaves the image hashed by its pixels; a count or value that does not fit is refused."""
    image = small_image()
    text = "<image>x<image>"
    prompt = {
        "prompt": text,
        "multi_modal_data": {"image": [image, image]},
        "multi_modal_uuids": {"image": ["cat-1", None]},
    }
    (parsed,) = as_prompts(prompt)
    assert parsed == ImagesPrompt(text, (image, image), ("cat-1", None))
    processor = image_processor()
    with_uuid = processor.process(RequestSpec("a", parsed), set()).images
    hashed = processor.process(RequestSpec("b", ImagesPrompt(text, (image, image))), set()).images
    assert with_uuid[0].identifier == "cat-1"
    assert with_uuid[1].identifier == hashed[1].identifier == hashed[0].identifier != "cat-1"
    for uuids in (["cat-1"], ["cat-1", ""], ["cat-1", 3]):
        with pytest.raises(InvalidRequestError) as refused:
            as_prompts({**prompt, "multi_modal_uuids": {"image": uuids}})
        assert (str(refused.value), refused.value.param) == (
            "multi_modal_uuids holds a non-empty string or None for each of the 2 images",
            "multi_modal_uuids",
        )


def test_more_images_than_the_limit_are_refused_before_any_is_processed() -> None:
    """--limit-mm-per-prompt '{"image": 1}': two images are refused, naming the flag, before
    either is looked at (these two are not even images)."""
    processor = image_processor(limit=1)
    chat = [{"role": "user", "content": [{"type": "image", "url": "x"}] * 2}]
    with pytest.raises(InvalidRequestError) as refused:
        processor.image_chat_prompt(chat)
    assert (str(refused.value), refused.value.param) == (
        "a prompt may hold at most 1 images (--limit-mm-per-prompt), this one holds 2",
        "messages",
    )
