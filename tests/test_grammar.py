"""Structured-output constraints: compiling, refusing, and masking logits row by row."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
import torch

from blockserve.errors import InvalidRequestError
from blockserve.grammar import GrammarCompiler, apply_token_masks
from blockserve.sampling_params import SamplingParams, StructuredOutputsParams
from tests.tiny_models import make_tokenizer


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return make_tokenizer()


@pytest.fixture(scope="module")
def compiler(tokenizer: Any) -> GrammarCompiler:
    return GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id])


def decode_constrained(
    compiler: GrammarCompiler, tokenizer: Any, params: StructuredOutputsParams, seed: int
) -> str:
    """Greedy decoding over random logits through the mask: whatever the model would say,
    the text is what the constraint allows. Stops at EOS; at most 256 tokens."""
    matcher = compiler.matcher(params)
    generator = torch.Generator().manual_seed(seed)
    ids: list[int] = []
    for _ in range(256):
        logits = torch.randn(1, len(tokenizer), generator=generator)
        assert apply_token_masks(logits, [matcher]) == {}
        token = int(logits.argmax())
        assert matcher.consume_token(token)
        if token == tokenizer.eos_token_id:
            return str(tokenizer.decode(ids))
        ids.append(token)
    raise AssertionError(f"no EOS within 256 tokens: {tokenizer.decode(ids)!r}")


@pytest.mark.parametrize("seed", range(5))
def test_regex_constraint_holds_over_random_logits(
    compiler: GrammarCompiler, tokenizer: Any, seed: int
) -> None:
    text = decode_constrained(
        compiler, tokenizer, StructuredOutputsParams(regex=r"[0-9]{3}-[a-z]{2}"), seed
    )
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", text), text


@pytest.mark.parametrize("seed", range(5))
def test_schema_constraint_yields_valid_json(
    compiler: GrammarCompiler, tokenizer: Any, seed: int
) -> None:
    schema = {
        "type": "object",
        "properties": {"unit": {"enum": ["c", "f"]}, "ok": {"type": "boolean"}},
        "required": ["unit", "ok"],
        "additionalProperties": False,
    }
    text = decode_constrained(compiler, tokenizer, StructuredOutputsParams(json=schema), seed)
    value = json.loads(text)
    assert list(value) == ["unit", "ok"]  # the schema's property order
    assert value["unit"] in ("c", "f") and isinstance(value["ok"], bool)


@pytest.mark.parametrize("seed", range(5))
def test_length_bounded_strings_stay_strict_json(
    compiler: GrammarCompiler, tokenizer: Any, seed: int
) -> None:
    """A string with maxLength, under random logits (which pick raw control bytes often in
    this byte-level vocabulary): strict JSON, escapes and all. xgrammar 0.2.9 fails this."""
    schema = {"type": "string", "minLength": 2, "maxLength": 8}
    text = decode_constrained(compiler, tokenizer, StructuredOutputsParams(json=schema), seed)
    value = json.loads(text)  # strict: a raw control character is an error
    assert isinstance(value, str) and 2 <= len(value) <= 8


def test_choice_constraint_yields_one_of_the_choices(
    compiler: GrammarCompiler, tokenizer: Any
) -> None:
    choices = ["yes", 'say "no"', "maybe\n"]
    texts = {
        decode_constrained(compiler, tokenizer, StructuredOutputsParams(choice=choices), seed)
        for seed in range(8)
    }
    assert texts <= set(choices) and texts


def test_grammar_constraint_follows_the_ebnf(compiler: GrammarCompiler, tokenizer: Any) -> None:
    grammar = 'root ::= "(" digit ("+" digit)* ")"\ndigit ::= [0-9]'
    text = decode_constrained(compiler, tokenizer, StructuredOutputsParams(grammar=grammar), 3)
    assert re.fullmatch(r"\([0-9](\+[0-9])*\)", text), text


def test_mask_leaves_unconstrained_rows_untouched(
    compiler: GrammarCompiler, tokenizer: Any
) -> None:
    """Rows without a matcher keep their exact logits; the constrained row keeps exactly the
    tokens that start one of the choices."""
    logits = torch.randn(3, len(tokenizer), generator=torch.Generator().manual_seed(0))
    before = logits.clone()
    matcher = compiler.matcher(StructuredOutputsParams(choice=["ab", "cd"]))
    assert apply_token_masks(logits, [None, matcher, None]) == {}
    assert torch.equal(logits[0], before[0]) and torch.equal(logits[2], before[2])
    allowed = {i for i in range(len(tokenizer)) if logits[1, i] != float("-inf")}
    texts = {i: tokenizer.decode([i]) for i in range(len(tokenizer))}
    expected = {i for i, t in texts.items() if t and ("ab".startswith(t) or "cd".startswith(t))}
    assert allowed == expected
    assert all(logits[1, i] == before[1, i] for i in allowed)


def test_no_matcher_means_no_work() -> None:
    logits = torch.zeros(2, 8)
    assert apply_token_masks(logits, [None, None]) == {}
    assert torch.equal(logits, torch.zeros(2, 8))


def test_matcher_resumes_over_tokens_already_generated(
    compiler: GrammarCompiler, tokenizer: Any
) -> None:
    """A sample resumed after preemption gets a matcher advanced over its output so far."""
    params = StructuredOutputsParams(choice=["abc", "xyz"])
    prefix = tokenizer.encode("ab", add_special_tokens=False)
    matcher = compiler.matcher(params, prefix)
    logits = torch.zeros(1, len(tokenizer))
    apply_token_masks(logits, [matcher])
    allowed = {tokenizer.decode([i]) for i in range(len(tokenizer)) if logits[0, i] == 0}
    assert allowed == {"c"}
    with pytest.raises(RuntimeError, match="breaks the sample's own constraint"):
        compiler.matcher(params, tokenizer.encode("q", add_special_tokens=False))


@pytest.mark.parametrize(
    ("params", "message"),
    [
        (StructuredOutputsParams(regex="(ab"), "error: unclosed group"),
        (StructuredOutputsParams(json={"type": "nope"}), "Invalid type: nope"),
        (StructuredOutputsParams(json={"format": "weird"}), "Unknown format: weird"),
        (StructuredOutputsParams(grammar="start: foo"), 'unknown name: "foo"'),
        (StructuredOutputsParams(json="[1, 2"), "the JSON schema is not valid JSON"),
        (StructuredOutputsParams(json="[1, 2]"), "the JSON schema must be an object"),
        (StructuredOutputsParams(grammar="root ::= ("), "Failed to convert the grammar from GBNF"),
    ],
)
def test_constraints_that_do_not_compile_name_the_field(
    compiler: GrammarCompiler, params: StructuredOutputsParams, message: str
) -> None:
    with pytest.raises(InvalidRequestError, match=re.escape(message)) as caught:
        compiler.compile(params)
    assert caught.value.param == "structured_outputs"
    assert "\n" not in str(caught.value)  # one line, without llguidance's caret drawings


@pytest.mark.parametrize(
    ("kwargs", "given"),
    [({}, "none"), ({"regex": "a", "choice": ["b"]}, "regex, choice")],
)
def test_exactly_one_constraint(kwargs: dict, given: str) -> None:
    with pytest.raises(InvalidRequestError, match=f"exactly one .* got {given}$"):
        StructuredOutputsParams(**kwargs)


def test_params_keep_the_schema_as_json_text_in_key_order() -> None:
    params = StructuredOutputsParams(json={"b": 1, "a": 2})
    assert params.json == '{"b":1,"a":2}' and params.kind == "json"
    assert StructuredOutputsParams(choice=["x"]).choice == ("x",)
    with pytest.raises(InvalidRequestError, match="non-empty strings"):
        StructuredOutputsParams(choice=["x", ""])
    sampling = SamplingParams(structured_outputs=params)
    assert hash(sampling) == hash(SamplingParams(structured_outputs=params))


def test_a_finished_constraint_allows_every_eos_token(tokenizer: Any) -> None:
    """A model with several EOS ids (Llama 3 has three) may end on any of them."""
    eos = [tokenizer.eos_token_id, 7]
    compiler = GrammarCompiler(tokenizer, len(tokenizer), eos)
    params = StructuredOutputsParams(choice=["ab"])
    matcher = compiler.matcher(params, tokenizer.encode("ab", add_special_tokens=False))
    logits = torch.zeros(1, len(tokenizer))
    apply_token_masks(logits, [matcher])
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == sorted(eos)


def test_a_matcher_for_a_bad_constraint_raises(compiler: GrammarCompiler) -> None:
    """The runner builds matchers without validating again; one that fails still raises (and
    fails that sample alone)."""
    with pytest.raises(RuntimeError, match=r'does not compile: .*unknown name: "foo"'):
        compiler.matcher(StructuredOutputsParams(grammar="start: foo"))


@pytest.mark.parametrize("seed", range(3))
def test_compact_json_is_json_dumps_spacing(tokenizer: Any, seed: int) -> None:
    """--structured-outputs-max-whitespace 0: one space after each comma and colon and none
    elsewhere, as json.dumps prints; the text parses and prints back the same."""
    compiler = GrammarCompiler(
        tokenizer, len(tokenizer), [tokenizer.eos_token_id], max_whitespace=0
    )
    schema = {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "array", "items": {"enum": [1, 2]}}},
        "required": ["a", "b"],
        "additionalProperties": False,
    }
    text = decode_constrained(compiler, tokenizer, StructuredOutputsParams(json=schema), seed)
    assert json.dumps(json.loads(text)) == text
