"""Constraints of the adversarial round, shared by the tests and benchmarks/bench_hostile.py."""

from __future__ import annotations

from typing import Any


def lark_chain(num_rules: int) -> str:
    """A Lark grammar of `num_rules` rules, each naming the next: llguidance's compiler
    recurses once per rule (3,000 of them overflowed an 8 MiB stack in llguidance 1.9)."""
    rules = ["start: r0", *(f"r{i}: r{i + 1}" for i in range(num_rules - 2))]
    return "\n".join([*rules, f'r{num_rules - 2}: "a"'])


def ref_chain(depth: int) -> dict[str, Any]:
    """A JSON schema whose `$ref`s chain `depth` definitions deep, down to a short string."""
    defs: dict[str, Any] = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(depth - 1)}
    defs[f"d{depth - 1}"] = {"type": "string", "maxLength": 3}
    return {"$ref": "#/$defs/d0", "$defs": defs}
