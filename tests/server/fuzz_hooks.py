"""Schemathesis hooks for the fuzzing test, loaded through SCHEMATHESIS_HOOKS: every generated
completion asks for at most a few tokens (a missing or larger `max_tokens` is set to 4), so the
run spends its time on inputs, not on generating text."""

from __future__ import annotations

from typing import Any

import schemathesis

MAX_TOKENS = 4
COMPLETION_PATHS = ("/v1/completions", "/v1/chat/completions")


@schemathesis.hook
def map_body(context: Any, body: Any) -> Any:
    if context.operation is None or context.operation.path not in COMPLETION_PATHS:
        return body
    if isinstance(body, dict):
        for key in ("max_tokens", "max_completion_tokens"):
            value = body.get(key)
            if value is None or (type(value) is int and value > MAX_TOKENS):
                body[key] = MAX_TOKENS
    return body
