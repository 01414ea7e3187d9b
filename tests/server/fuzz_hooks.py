"""Schemathesis hooks for the fuzzing test, loaded through SCHEMATHESIS_HOOKS: every completion
it sends asks for at most a few tokens (a missing, null or larger `max_tokens` is set to 4), so
the run spends its time on inputs, not on generating text. `before_call` sees every phase's
cases (the coverage phase's too, which `map_body` does not)."""

from __future__ import annotations

from typing import Any

import schemathesis

MAX_TOKENS = 4
COMPLETION_PATHS = ("/v1/completions", "/v1/chat/completions")


@schemathesis.hook
def before_call(context: Any, case: Any, kwargs: Any) -> None:
    if case.operation.path not in COMPLETION_PATHS or not isinstance(case.body, dict):
        return
    for key in ("max_tokens", "max_completion_tokens"):
        value = case.body.get(key)
        if value is None or (type(value) is int and value > MAX_TOKENS):
            case.body[key] = MAX_TOKENS
