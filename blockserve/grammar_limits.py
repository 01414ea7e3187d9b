"""Bounds on a structured-outputs constraint, checked in Python before the grammar library's
native code sees it: a constraint within them cannot exhaust its compiler's stack (a chain of
3,000 Lark rules did) or hold a compile worker for long. Each bound has a flag
(`--structured-outputs-max-*`); what exceeds one is a 400 naming the field and the flag."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from blockserve.errors import InvalidRequestError
from blockserve.sampling_params import StructuredOutputsParams

_FIELD = "structured_outputs"
# A rule's definition: Lark's `name:` / `NAME.2:` at a line's start, GBNF's `name ::=` anywhere.
_LARK_RULE = re.compile(r"^[ \t]*[?!]?[A-Za-z_][\w.-]*(?:\{[^}\n]*\})?[ \t]*:(?!:)", re.MULTILINE)
_GBNF_RULE = re.compile(r"::=")
# A `$ref` key inside a grammar's embedded schema has a dollar sign, as is or escaped.
_DOLLAR = re.compile(r"\$|\\u0024", re.IGNORECASE)
_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.DOTALL)


@dataclass(frozen=True, slots=True)
class ConstraintLimits:
    """What one constraint may contain. Rules are a grammar's rule definitions or a schema's
    `$ref`s (each a rule the compiler follows, recursively); nesting is a schema's JSON depth."""

    max_bytes: int = 65536
    max_rules: int = 1000
    max_choices: int = 1000
    max_nesting: int = 64
    compile_timeout_s: float = 10.0

    def check(self, params: StructuredOutputsParams) -> None:
        """InvalidRequestError naming the first bound the constraint exceeds."""
        text = _text(params)
        size = len(text.encode("utf-8", "surrogatepass"))
        if size > self.max_bytes:
            _refuse(f"is {size} bytes", f"{self.max_bytes} bytes", "bytes")
        if params.choice is not None and len(params.choice) > self.max_choices:
            _refuse(f"has {len(params.choice)} choices", str(self.max_choices), "choices")
        if params.json is not None:  # the depth first: parsing recurses that deep
            depth = json_depth(params.json)
            if depth > self.max_nesting:
                _refuse(f"nests {depth} levels deep", f"{self.max_nesting} levels", "nesting")
        rules = _num_rules(params, text)
        if rules > self.max_rules:
            _refuse(f"has {rules} rules or $refs", str(self.max_rules), "rules")


def json_depth(text: str) -> int:
    """How deeply a JSON text's objects and arrays nest, without parsing it (a parser would
    recurse that deep): brackets outside strings, counted."""
    brackets = _JSON_STRING.sub("", text)
    depth = deepest = 0
    for char in brackets:
        if char in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif char in "]}":
            depth -= 1
    return deepest


def _text(params: StructuredOutputsParams) -> str:
    if params.choice is not None:
        return "".join(json.dumps(c) for c in params.choice)
    return params.json or params.regex or params.grammar or ""


def _num_rules(params: StructuredOutputsParams, text: str) -> int:
    if params.grammar is not None:  # a grammar may embed schemas (llguidance's %json)
        return sum(len(p.findall(text)) for p in (_LARK_RULE, _GBNF_RULE, _DOLLAR))
    if params.json is not None:
        try:
            return _num_refs(json.loads(text))
        except ValueError:
            return 0  # not JSON: the compiler says so, naming the field
    return 0


def _num_refs(schema: object) -> int:
    """`$ref` keys anywhere in a parsed schema (walked without recursion)."""
    count, pending = 0, [schema]
    while pending:
        node = pending.pop()
        if isinstance(node, dict):
            count += "$ref" in node
            pending.extend(node.values())
        elif isinstance(node, list):
            pending.extend(node)
    return count


def _refuse(what: str, bound: str, flag: str) -> None:
    raise InvalidRequestError(
        f"the structured-outputs constraint {what}; at most {bound} are allowed "
        f"(--structured-outputs-max-{flag})",
        _FIELD,
    )
