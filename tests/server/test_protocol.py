"""Request models: OpenAI's fields and vLLM's extras map onto SamplingParams exactly."""

from __future__ import annotations

import pydantic
import pytest

from blockserve.errors import InvalidRequestError
from blockserve.sampling_params import SamplingParams
from blockserve.server.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    TokenizeRequest,
)


def test_completion_fields_become_sampling_params() -> None:
    """Unset OpenAI fields take vLLM's defaults; the extras pass through."""
    body = CompletionRequest(
        prompt="hi", stop="END", top_k=5, min_p=0.1, seed=3, ignore_eos=True, stop_token_ids=[9]
    )
    assert body.sampling_params(None, body.logprobs) == SamplingParams(
        max_tokens=16,
        stop=("END",),
        top_k=5,
        min_p=0.1,
        seed=3,
        ignore_eos=True,
        stop_token_ids=(9,),
    )


def test_prompts_take_every_openai_shape() -> None:
    """Text, token ids, and lists of either; token ids arrive as tuples."""
    assert CompletionRequest(prompt="a").prompts() == ["a"]
    assert CompletionRequest(prompt=[1, 2]).prompts() == [(1, 2)]
    assert CompletionRequest(prompt=["a", "b"]).prompts() == ["a", "b"]
    assert CompletionRequest(prompt=[[1], [2, 3]]).prompts() == [(1,), (2, 3)]


def test_stream_options_need_stream() -> None:
    """stream_options without stream is a validation error (a 400 at the server)."""
    with pytest.raises(pydantic.ValidationError, match="stream_options"):
        CompletionRequest(prompt="a", stream_options={"include_usage": True})  # type: ignore[arg-type]


def test_chat_token_limits_and_logprobs() -> None:
    """max_completion_tokens wins over max_tokens; top_logprobs needs logprobs."""
    chat = ChatCompletionRequest(
        messages=[ChatMessage(role="user", content="x")], max_tokens=5, max_completion_tokens=7
    )
    assert (chat.requested_max_tokens(), chat.num_logprobs()) == (7, None)
    with_logprobs = ChatCompletionRequest(
        messages=[ChatMessage(role="user", content="x")], logprobs=True, top_logprobs=2
    )
    assert with_logprobs.num_logprobs() == 2
    refused = ChatCompletionRequest(
        messages=[ChatMessage(role="user", content="x")], top_logprobs=2
    )
    with pytest.raises(InvalidRequestError, match="top_logprobs requires logprobs"):
        refused.num_logprobs()


def test_message_text_joins_text_parts_and_refuses_others() -> None:
    """Text parts are joined; an image part is refused with its type named."""
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    assert ChatMessage(role="user", content=parts).text() == "ab"
    assert ChatMessage(role="assistant", content=None).text() == ""
    image = ChatMessage(role="user", content=[{"type": "image_url", "image_url": {}}])
    with pytest.raises(InvalidRequestError, match="'image_url' is not supported"):
        image.text()


def test_image_url_parts_become_image_parts_with_their_url() -> None:
    """Both of OpenAI's forms (`{"url": ...}` and the bare string); a part without a URL
    string, or of another type, is refused."""
    content = [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}},
        {"type": "text", "text": "and"},
        {"type": "image_url", "image_url": "data:image/png;base64,BB=="},
    ]
    message = ChatMessage(role="user", content=content)
    assert message.has_images() and message.parts() == [
        {"type": "image", "url": "data:image/png;base64,AA==", "uuid": None},
        {"type": "text", "text": "and"},
        {"type": "image", "url": "data:image/png;base64,BB==", "uuid": None},
    ]
    tagged = {"type": "image_url", "image_url": "data:image/png;base64,AA==", "uuid": "cat-7"}
    assert ChatMessage(role="user", content=[tagged]).parts()[0]["uuid"] == "cat-7"
    for part, words in (
        ({"type": "image_url", "image_url": {}}, "an image_url part holds a URL string"),
        ({"type": "input_audio"}, "content part type 'input_audio' is not supported"),
        ({**tagged, "uuid": ""}, "an image part's uuid is a non-empty string"),
    ):
        with pytest.raises(InvalidRequestError, match=words):
            ChatMessage(role="user", content=[part]).parts()


def test_tokenize_takes_exactly_one_input() -> None:
    """Either a prompt or messages, never both, never neither."""
    assert TokenizeRequest(prompt="x").prompt == "x"
    for fields in ({}, {"prompt": "x", "messages": [{"role": "user", "content": "y"}]}):
        with pytest.raises(pydantic.ValidationError, match="exactly one"):
            TokenizeRequest(**fields)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("requested", "default", "cap", "decided"),
    [
        (None, None, None, None),  # a completion with max_tokens null: up to the context
        (None, 100, None, 100),  # a chat without one: the server's default
        (50, 100, None, 50),  # the request's own wins over the default
        (50, 100, 20, 20),  # the generation config caps the request's
        (None, 100, 20, 20),  # ... and the default
        (None, None, 20, 20),  # ... and no limit at all
    ],
)
def test_max_tokens_is_decided_in_one_place(
    requested: int | None, default: int | None, cap: int | None, decided: int | None
) -> None:
    """The request's own, else the default; the generation config's max_tokens caps it."""
    chat = ChatCompletionRequest(
        messages=[ChatMessage(role="user", content="x")], max_tokens=requested
    )
    defaults = {} if cap is None else {"max_tokens": cap}
    assert chat.decide_max_tokens(default, defaults) == decided
    assert chat.sampling_params(default, None, None, defaults).max_tokens == decided
