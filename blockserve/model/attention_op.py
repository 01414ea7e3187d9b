"""Attention as an operator of ours, so that a compiled model graph calls it without tracing it."""

from __future__ import annotations

from typing import Any

import torch
from torch._library.opaque_object import get_opaque_type_name, register_opaque_type
from torch._opaque_base import OpaqueBase

from blockserve.attention.metadata import AttentionBackend


class AttentionStep(OpaqueBase):
    """One step's attention: the backend and the plan it prepared for the step.

    torch.compile traces the model's tensor math into one graph, but attention cannot be traced:
    its per-step plan is Python the backend built (ranges, optional parts, a reused workspace).
    So under compilation the model hands attention to `blockserve::attention`, whose last
    argument is an `AttentionStep`: the backend and this step's plan, registered with torch as
    an opaque reference type. The graph takes the step as an input like its tensors and passes
    it to the operator without looking inside, so one graph serves every step whatever the batch
    holds. An eager forward calls the backend directly.
    """

    def __init__(self, backend: AttentionBackend, plan: Any) -> None:
        self.backend = backend
        self.plan = plan


register_opaque_type(AttentionStep, typ="reference")

_LIBRARY = torch.library.Library("blockserve", "FRAGMENT")
_LIBRARY.define(
    "attention(Tensor query, Tensor key, Tensor value, Tensor(a!) kv_cache, "
    f"{get_opaque_type_name(AttentionStep)} step) -> Tensor"
)


def _attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    step: AttentionStep,
) -> torch.Tensor:
    return step.backend.forward(query, key, value, kv_cache, step.plan)


_LIBRARY.impl("attention", _attention, "CompositeExplicitAutograd")


@torch.library.register_fake("blockserve::attention")
def _attention_fake(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    step: AttentionStep,
) -> torch.Tensor:
    return torch.empty_like(query)  # [num_tokens, heads, dim]


def attend(
    backend: AttentionBackend,
    query: torch.Tensor,  # [num_tokens, heads, dim]
    key: torch.Tensor,  # [num_tokens, kv_heads, dim]
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    plan: Any,  # the backend's plan, or an AttentionStep carrying it (compiled forward)
) -> torch.Tensor:
    if isinstance(plan, AttentionStep):
        return torch.ops.blockserve.attention(query, key, value, kv_cache, plan)
    return backend.forward(query, key, value, kv_cache, plan)
