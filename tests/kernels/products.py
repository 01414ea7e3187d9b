"""What the tests of our few-row products share: integer operands whose products and sums are
exact in float32, a spy on the accessor that hands a product kernel out, and a host whose
memory lets the weights' copies take a given number of bytes."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from blockserve.kernels import CpuKernels
from blockserve.model import weight_copies
from blockserve.platform import Memory


def small_ints(*shape: int, seed: int, dtype: torch.dtype) -> torch.Tensor:
    """Integers in [-2, 2] in `dtype`: every product and sum of them is exact in float32."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(-2, 3, shape, generator=generator).to(dtype)


def exact(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x · weightᵀ + bias in float64, in x's dtype."""
    out = x.double() @ weight.double().T
    if bias is not None:
        out += bias.double()
    return out.to(x.dtype)


def int_linear(in_features: int, out_features: int, seed: int, dtype: torch.dtype) -> nn.Linear:
    linear = nn.Linear(in_features, out_features).to(dtype)
    with torch.no_grad():
        linear.weight.copy_(small_ints(out_features, in_features, seed=seed, dtype=dtype))
        linear.bias.copy_(small_ints(out_features, seed=seed + 1, dtype=dtype))
    return linear


def spy_on_rows(monkeypatch: pytest.MonkeyPatch, kernels: CpuKernels, accessor: str) -> list[int]:
    """Wrap `kernels.<accessor>` (tile_linear, vector_linear) so that each product the kernel
    it hands out is given records its rows in the list returned."""
    calls: list[int] = []
    find = getattr(kernels, accessor)

    def spying(*args: Any) -> Any:
        op = find(*args)
        if op is None:
            return None

        def call(rows: torch.Tensor, *rest: Any) -> torch.Tensor:
            calls.append(rows.shape[0])
            return op(rows, *rest)

        return call

    monkeypatch.setattr(kernels, accessor, spying)
    return calls


def copies_may_take(monkeypatch: pytest.MonkeyPatch, budget: int) -> None:
    """Make the host's available memory what lets one kind of copy take `budget` bytes."""
    free = round(budget / weight_copies.COPY_SHARE)
    monkeypatch.setattr(weight_copies, "host_memory", lambda: Memory(free=free, total=2 * free))
    assert weight_copies.copy_budget() == budget


class RecordedOps:
    """Layer operators (`ops`) that record the name of each one looked up."""

    def __init__(self, ops: Any) -> None:
        self.ops, self.calls = ops, []

    def __getattr__(self, name: str) -> Any:
        self.calls.append(name)
        return getattr(self.ops, name)


def silu_operators(gate_up: Any, ops: Any, rows: int, generator: torch.Generator) -> list[str]:
    """The layer operators `gate_up.silu_and_mul` calls for `rows` random bf16 rows, having
    checked that its result has the bits of SiLU over `gate_up`'s own product."""
    x = torch.randn(rows, gate_up.in_features, generator=generator).bfloat16()
    recorded = RecordedOps(ops)
    assert torch.equal(gate_up.silu_and_mul(x, recorded), ops.silu_and_mul(gate_up(x)))
    return recorded.calls
