"""Constraint limits (grammar_limits.py) and the compile worker (grammar.py): the inputs that
took a server down are 400s before the grammar library sees them, and what the limits let
through compiles on a worker whose stack has room to spare."""

from __future__ import annotations

import json
from typing import Any

import pytest

from blockserve.errors import InvalidRequestError
from blockserve.grammar import GrammarCompiler
from blockserve.grammar_limits import ConstraintLimits, json_depth
from blockserve.sampling_params import StructuredOutputsParams
from tests.hostile_inputs import lark_chain
from tests.hostile_inputs import ref_chain as ref_chain_schema
from tests.tiny_models import make_tokenizer


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return make_tokenizer()


def compiler(tokenizer: Any, **limits: Any) -> GrammarCompiler:
    return GrammarCompiler(
        tokenizer, len(tokenizer), [tokenizer.eos_token_id], limits=ConstraintLimits(**limits)
    )


def rule_chain(num_rules: int) -> StructuredOutputsParams:
    return StructuredOutputsParams(grammar=lark_chain(num_rules))


def ref_chain(depth: int) -> StructuredOutputsParams:
    return StructuredOutputsParams(json=ref_chain_schema(depth))


@pytest.mark.parametrize(
    ("params", "flag"),
    [
        (rule_chain(3000), "--structured-outputs-max-rules"),
        (ref_chain(1001), "--structured-outputs-max-rules"),
        (StructuredOutputsParams(choice=[f"c{i}" for i in range(100_000)]), "max-bytes"),
        (StructuredOutputsParams(choice=[str(i) for i in range(1001)]), "max-choices"),
        (StructuredOutputsParams(regex="a" * 70_000), "max-bytes"),
    ],
    ids=["lark-3000-rules", "ref-chain-1001", "choice-100k", "choice-1001", "regex-70kB"],
)
def test_what_crashed_or_stalled_a_server_is_refused_naming_its_flag(
    tokenizer: Any, params: StructuredOutputsParams, flag: str
) -> None:
    """Each is a 400 on the structured_outputs field that names the limit's flag."""
    with pytest.raises(InvalidRequestError, match=flag) as refused:
        compiler(tokenizer).compile(params)
    assert refused.value.param == "structured_outputs"


def test_a_schema_nested_past_the_limit_is_refused_without_parsing_it(tokenizer: Any) -> None:
    """3,001 levels (deeper than Python's own parser recurses) and 65 are refused by depth;
    with the limit raised, 151 reach the library, which refuses them itself: still a 400."""

    def nested(depth: int) -> str:
        return '{"type":"array","items":' * depth + '{"type":"string"}' + "}" * depth

    assert json_depth(nested(3000)) == 3001
    for depth in (3000, 64):
        with pytest.raises(InvalidRequestError, match=r"nests .* levels deep") as refused:
            compiler(tokenizer, max_bytes=1 << 20).compile(
                StructuredOutputsParams(json=nested(depth))
            )
        assert "--structured-outputs-max-nesting" in str(refused.value)
    with pytest.raises(InvalidRequestError, match="does not compile"):
        compiler(tokenizer, max_nesting=200).compile(StructuredOutputsParams(json=nested(150)))


def test_json_depth_counts_brackets_outside_strings_only() -> None:
    """Brackets inside strings (escaped quotes included) do not nest."""
    assert json_depth('{"a": "[[[{{\\"]]"}') == 1
    assert json_depth('[[1], {"b": [2]}]') == 3


def test_escaped_refs_count_as_refs() -> None:
    """A `$ref` key spelled with a JSON escape is a rule the compiler follows all the same."""
    schema = '{"$defs": {"a": {"\\u0024ref": "#/$defs/b"}, "b": {}}, "\\u0024ref": "#/$defs/a"}'
    assert json.loads(schema)["$ref"] == "#/$defs/a"
    ConstraintLimits(max_rules=2).check(StructuredOutputsParams(json=schema))
    with pytest.raises(InvalidRequestError, match=r"has 2 rules or \$refs"):
        ConstraintLimits(max_rules=1).check(StructuredOutputsParams(json=schema))


def test_a_chain_at_the_limit_compiles_and_twenty_times_it_still_fits_the_stack(
    tokenizer: Any,
) -> None:
    """1,000 rules and a chain of 1,000 $refs (the default limit; such a chain took a server
    down) compile; with the limits raised, 20,000 rules compile too on the worker's 64 MiB
    stack (on an 8 MiB one 3,000 overflowed): the bound has headroom."""
    compiler(tokenizer).compile(rule_chain(1000))
    compiler(tokenizer).compile(ref_chain(1000))
    raised = compiler(tokenizer, max_rules=25_000, max_bytes=1 << 20)
    raised.compile(rule_chain(20_000))
    assert raised.matcher(rule_chain(20_000)).consume_token(tokenizer.convert_tokens_to_ids("a"))


def test_a_compile_past_its_time_limit_is_a_400(tokenizer: Any) -> None:
    """The caller waits at most --structured-outputs-compile-timeout."""
    slow = compiler(tokenizer, compile_timeout_s=1e-9)
    with pytest.raises(InvalidRequestError, match="did not compile within"):
        slow.compile(StructuredOutputsParams(choice=[f"choice {i}" for i in range(1000)]))


def test_each_sample_gets_its_own_copy_of_the_kept_matcher(tokenizer: Any) -> None:
    """matcher() hands each sample a matcher of its own: one advanced to the end of "yes"
    leaves the next one at the start."""
    kept = compiler(tokenizer)
    params = StructuredOutputsParams(choice=["yes", "no"])
    kept.compile(params)
    first = kept.matcher(params)
    assert first.consume_tokens(tokenizer.encode("yes"))
    assert first.is_accepting()
    second = kept.matcher(params)
    assert not second.is_accepting()
    assert second.consume_tokens(tokenizer.encode("no"))
