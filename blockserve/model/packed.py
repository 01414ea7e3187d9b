"""Linear layers with their weights reordered once into oneDNN's blocked layout (CPU).

`F.linear` hands oneDNN the row-major weight on every call; a weight reordered once at load
into oneDNN's own layout is faster on this model's shapes. `benchmarks/bench_matmul.py`
measures both (docs/benchmarks.md, "Compute floor"): the small decode and LM-head products
gain most. Results equal `F.linear`'s bit for bit in bfloat16 and within float32 rounding
(accumulation order) in float32.

Under `torch.compile` the product goes through `blockserve::packed_linear`, an operator of our
own that inductor calls as an opaque kernel: inductor lowers oneDNN's linear only over weights
it has frozen into the graph itself (its `freezing` mode), while ours are packed at load and
stay inputs of the graph (model/compile.py).
"""

from __future__ import annotations

import torch
from torch import nn

_LIBRARY = torch.library.Library("blockserve", "FRAGMENT")
_LIBRARY.define("packed_linear(Tensor x, Tensor packed, Tensor? bias) -> Tensor")


def _packed_linear(
    x: torch.Tensor,  # [rows, in_features]
    packed: torch.Tensor,  # the weight in oneDNN's layout; its shape is [out, in]
    bias: torch.Tensor | None,
) -> torch.Tensor:  # [rows, out_features]
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


# A thin registration: torch.library.custom_op's wrapper cost ~20 us a call, measured on the
# decode-sized product; this one ~5 us.
_LIBRARY.impl("packed_linear", _packed_linear, "CompositeExplicitAutograd")


@torch.library.register_fake("blockserve::packed_linear")
def _packed_linear_fake(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    return x.new_empty(x.shape[0], packed.shape[0])


def can_prepack(device: torch.device | str) -> bool:
    return torch.device(device).type == "cpu" and torch.backends.mkldnn.is_available()


class PackedLinear(nn.Module):
    """An `nn.Linear`'s forward over a weight reordered for oneDNN (the original is dropped)."""

    packed: torch.Tensor
    bias: torch.Tensor | None

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        weight = linear.weight.detach()
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        self.register_buffer("packed", packed, persistent=False)
        bias = None if linear.bias is None else linear.bias.detach()
        self.register_buffer("bias", bias, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if torch.compiler.is_compiling():
            out = torch.ops.blockserve.packed_linear(rows, self.packed, self.bias)
        else:
            out = _packed_linear(rows, self.packed, self.bias)
        return out.view(*x.shape[:-1], self.out_features)


def prepack_linears(model: nn.Module) -> int:
    """Replace every `nn.Linear` under `model` by a `PackedLinear`; returns how many."""
    targets = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if isinstance(child, nn.Linear)
    ]
    for parent, name, child in targets:
        setattr(parent, name, PackedLinear(child))
    return len(targets)
