"""Many adapters in one step: a pool of `max_loras` slots holding stacked A [in, R] and B [R,
out] per projection (zero past an adapter's rank), the step's tokens grouped by slot, and each
group's `x @ A[slot] @ B[slot]` added to the base projection's output slice (Punica's segmented
gather-matmul, as batched torch ops; base-model tokens take no product)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from blockserve.lora.adapter import LoRAAdapter, module_shapes
from blockserve.model.arch import LlamaArchConfig

# Each fused projection and the PEFT modules its output holds, in order.
FUSED = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "o_proj": ("o_proj",),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "down_proj": ("down_proj",),
}


@dataclass
class LoRAStep:
    """The current step's token groups: (slot, the rows of its tokens), shared by every
    wrapped projection; set before each forward."""

    segments: list[tuple[int, torch.Tensor]] = field(default_factory=list)


class LoRASlots:
    """The slot pool: per (layer, module) A [slots, in, R] and B [slots, R, out]."""

    def __init__(
        self,
        arch: LlamaArchConfig,
        max_loras: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.a: dict[tuple[int, str], torch.Tensor] = {}
        self.b: dict[tuple[int, str], torch.Tensor] = {}
        for module, (fan_in, fan_out) in module_shapes(arch).items():
            for layer in range(arch.num_layers):
                shape_a, shape_b = (max_loras, fan_in, max_rank), (max_loras, max_rank, fan_out)
                self.a[layer, module] = torch.zeros(shape_a, dtype=dtype, device=device)
                self.b[layer, module] = torch.zeros(shape_b, dtype=dtype, device=device)
        self.resident: list[str | None] = [None] * max_loras

    def install(self, adapter: LoRAAdapter, slot: int) -> None:
        """Put `adapter` in `slot`: its modules' A and B, zeros for every other module."""
        for key, a_stack in self.a.items():
            a_stack[slot].zero_()
            self.b[key][slot].zero_()
            pair = adapter.weights.get(key)
            if pair is not None:
                a, b = pair
                a_stack[slot, :, : a.shape[1]].copy_(a)
                self.b[key][slot, : b.shape[0]].copy_(b)
        self.resident[slot] = adapter.name


class LoRALinear(nn.Module):
    """A fused projection plus, for each token under an adapter, its low-rank update."""

    def __init__(
        self, base: nn.Module, layer: int, fused: str, arch: LlamaArchConfig,
        slots: LoRASlots, step: LoRAStep,
    ) -> None:  # fmt: skip
        super().__init__()
        self.base = base
        shapes = module_shapes(arch)
        offsets, start = [], 0
        for module in FUSED[fused]:
            offsets.append((module, start, shapes[module][1]))
            start += shapes[module][1]
        self.layer, self.offsets, self.slots, self.step = layer, offsets, slots, step

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        for slot, rows in self.step.segments:
            xs = x.index_select(0, rows)
            for module, start, size in self.offsets:
                a, b = self.slots.a[self.layer, module], self.slots.b[self.layer, module]
                out[:, start : start + size].index_add_(0, rows, (xs @ a[slot]) @ b[slot])
        return out


def wrap_projections(model: nn.Module, arch: LlamaArchConfig, slots: LoRASlots) -> LoRAStep:
    """Wrap every fused projection of `model`'s layers; the step object they all read."""
    step = LoRAStep()
    layers: Any = model.model.layers  # type: ignore[union-attr]
    for index, layer in enumerate(layers):
        for owner, name in (
            (layer.self_attn, "qkv_proj"), (layer.self_attn, "o_proj"),
            (layer.mlp, "gate_up_proj"), (layer.mlp, "down_proj"),
        ):  # fmt: skip
            base = getattr(owner, name)
            wrapped = LoRALinear(
                base=base, layer=index, fused=name, arch=arch, slots=slots, step=step
            )
            setattr(owner, name, wrapped)
    return step
