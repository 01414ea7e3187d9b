"""The served tokenizer: chat templates render as transformers renders them, decoding cleans
up as transformers does, one tokenizer serves many threads, and it pickles."""

from __future__ import annotations

import concurrent.futures
import copy
import pickle
from typing import Any

import jinja2
import pytest
from tokenizers import Tokenizer as Backend
from tokenizers import models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from blockserve.model.tokenizer import Tokenizer
from tests.tiny_models import TRAINING_TEXT, make_tokenizer

# One template that uses what templates get from transformers: tojson (unescaped, non-ASCII
# kept), loop controls, the generation tag, reasoning under its aliases, the named special
# tokens, raise_exception, and keys that are None.
FEATURES = (
    "{{ bos_token }}{% if tools %}{{ tools | tojson }}{% endif %}"
    "{% for m in messages %}{% if m['role'] == 'skip' %}{% continue %}{% endif %}"
    "{% if m['role'] == 'bad' %}{{ raise_exception('bad role: ' + m['content']) }}{% endif %}"
    "<|{{ m['role'] }}|>{% if m.reasoning_content %}({{ m.reasoning_content }}|"
    "{{ m.thinking }}){% endif %}{% if m.name is defined %}[{{ m.name }}]{% endif %}"
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}{% endgeneration %}"
    "{% else %}{{ m['content'] | tojson }}{% endif %}{{ eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
TOOLS = [{"type": "function", "function": {"name": "café", "parameters": {"a": "<b>"}}}]


@pytest.fixture(scope="module")
def reference() -> PreTrainedTokenizerFast:
    tokenizer = make_tokenizer()
    tokenizer.bos_token = "<eos>"
    return tokenizer


@pytest.fixture(scope="module")
def tokenizer(reference: PreTrainedTokenizerFast) -> Tokenizer:
    return Tokenizer.from_transformers(reference)


def render(tokenizer: Any, messages: list[dict[str, Any]], **kwargs: Any) -> str:
    return str(tokenizer.apply_chat_template(messages, tokenize=False, **kwargs))


@pytest.mark.parametrize(
    "messages",
    [
        [{"role": "user", "content": 'naïve <tag> "q"'}, {"role": "skip", "content": "x"}],
        [{"role": "assistant", "content": "4", "reasoning": "2+2", "name": None}],
        [{"role": "assistant", "content": "4", "thinking": "sum"}, {"role": "user", "content": ""}],
        [{"role": "user", "content": "hi", "name": "ann"}],
    ],
)
def test_templates_render_as_transformers_renders_them(
    tokenizer: Tokenizer, reference: PreTrainedTokenizerFast, messages: list[dict[str, Any]]
) -> None:
    """With and without tools and the generation prompt, the text is transformers' own."""
    for template_kwargs in ({}, {"tools": TOOLS}, {"add_generation_prompt": True}):
        expected = render(reference, messages, chat_template=FEATURES, **template_kwargs)
        served = copy.deepcopy(tokenizer)
        served.chat_template = FEATURES
        assert render(served, messages, **template_kwargs) == expected


def test_a_template_that_raises_raises_template_error(tokenizer: Tokenizer) -> None:
    """raise_exception in a template is a jinja2 TemplateError carrying its message."""
    served = copy.deepcopy(tokenizer)
    served.chat_template = FEATURES
    with pytest.raises(jinja2.TemplateError, match="bad role: x"):
        render(served, [{"role": "bad", "content": "x"}])


def test_named_templates_pick_tool_use_for_tools(tokenizer: Tokenizer) -> None:
    """Among named templates, `tool_use` renders a conversation with tools, `default` one
    without; with no default, and with no template at all, it is a ValueError."""
    served = copy.deepcopy(tokenizer)
    served.chat_template = {"default": "plain", "tool_use": "tools {{ tools | length }}"}
    messages = [{"role": "user", "content": "hi"}]
    assert render(served, messages) == "plain"
    assert render(served, messages, tools=TOOLS) == "tools 1"
    served.chat_template = {"tool_use": "tools"}
    with pytest.raises(ValueError, match=r"no default among .*\['tool_use'\]"):
        render(served, messages)
    served.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        render(served, messages)


def test_chat_ids_are_the_rendered_text_without_added_special_tokens(
    tokenizer: Tokenizer,
) -> None:
    messages = [{"role": "user", "content": "hello world"}]
    text = render(tokenizer, messages, add_generation_prompt=True)
    assert text == "<|user|>hello world<eos><|assistant|>"
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert ids == tokenizer.encode(text, add_special_tokens=False)


def wordpiece_tokenizer(clean_up: bool) -> PreTrainedTokenizerFast:
    words = sorted({w for line in TRAINING_TEXT for w in line.replace("?", " ?").split()})
    vocab = {w: i for i, w in enumerate(["[UNK]", ".", ",", "?", "'", "s", *words])}
    backend = Backend(models.WordPiece(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="[UNK]", clean_up_tokenization_spaces=clean_up
    )


@pytest.mark.parametrize("clean_up", [True, False])
def test_decoding_cleans_up_spaces_where_transformers_does(clean_up: bool) -> None:
    """A WordPiece tokenizer that asks for it gets the spaces before punctuation removed,
    exactly as transformers' decode does; a byte-level BPE one never does (transformers
    skips it there)."""
    reference = wordpiece_tokenizer(clean_up)
    served = Tokenizer.from_transformers(reference)
    ids = reference.encode("the fox , the dog . paris ? hello's world", add_special_tokens=False)
    assert served.clean_up_tokenization_spaces is clean_up
    assert served.decode(ids) == reference.decode(ids)
    assert (" ," in served.decode(ids)) is not clean_up
    bpe = make_tokenizer()
    bpe.clean_up_tokenization_spaces = True
    assert Tokenizer.from_transformers(bpe).clean_up_tokenization_spaces is False


def test_one_tokenizer_serves_many_threads(tokenizer: Tokenizer) -> None:
    """Eight threads encoding and decoding at once, special tokens split or not, get what
    one thread gets."""
    texts = [f"{line} <eos> {i}" for i, line in enumerate(TRAINING_TEXT)]

    def work(text: str) -> tuple[list[int], list[int], str]:
        ids = tokenizer.encode(text)
        return ids, tokenizer.encode(text, split_special_tokens=True), tokenizer.decode(ids)

    expected = [work(text) for text in texts]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        assert list(pool.map(work, texts)) == expected
    assert all(text == decoded for text, (_, _, decoded) in zip(texts, expected, strict=True))
    eos = tokenizer.eos_token_id
    assert eos is not None and all(eos in ids and eos not in split for ids, split, _ in expected)


def test_it_pickles_as_what_it_was_built_from(tokenizer: Tokenizer) -> None:
    """A copy sent to another process encodes, decodes and templates alike."""
    copied = pickle.loads(pickle.dumps(tokenizer))
    messages = [{"role": "user", "content": "hi"}]
    assert copied.encode("hello blocks") == tokenizer.encode("hello blocks")
    assert copied.special_tokens_map == tokenizer.special_tokens_map
    assert render(copied, messages) == render(tokenizer, messages)


def test_a_tokenizer_without_a_backend_is_refused() -> None:
    with pytest.raises(ValueError, match="object has no `tokenizers` backend"):
        Tokenizer.from_transformers(object())
