"""Many adapters in one step: a pool of `max_loras` slots of stacked A and B per projection,
the step's tokens grouped by slot, each group's `x @ A[slot] @ B[slot]` added to the base
projection's output rows (Punica's segmented gather-matmul: our CPU kernel, a Triton kernel on
CUDA, else batched torch ops; base-model tokens take no product)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from blockserve.kernels import CpuKernels
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
    """The current step's grouping, shared by every wrapped projection (set before each
    forward): `slots` [G] the slots of its G adapters, ascending; `src` [N] the rows of their
    tokens, group by group; `dest` [N] each token's place in a [G, width] padded layout (None
    when every group has `width` tokens: `src` order is the layout)."""

    slots: torch.Tensor | None = None
    src: torch.Tensor | None = None
    dest: torch.Tensor | None = None
    width: int = 0
    all_slots: bool = False  # slots == every slot, in order: the stacks need no gather
    starts: torch.Tensor | None = None  # [G + 1]: where each group's rows begin in `src`


class LoRAProducts(Protocol):
    """How a wrapped projection's grouped products run (each adapter token's
    `x @ A[slot] @ B[slot]` added to its row of `out`), chosen once when the projections are
    wrapped."""

    def __call__(
        self, layer: LoRALinear, x: torch.Tensor, out: torch.Tensor, step: LoRAStep
    ) -> torch.Tensor: ...


class TorchProducts:
    """Two torch `bmm` over the step's adapter tokens laid out [adapters, width]."""

    def __call__(
        self, layer: LoRALinear, x: torch.Tensor, out: torch.Tensor, step: LoRAStep
    ) -> torch.Tensor:
        assert step.slots is not None and step.src is not None
        a = layer.a if step.all_slots else layer.a.index_select(0, step.slots)
        b = layer.b if step.all_slots else layer.b.index_select(0, step.slots)
        groups, width = a.shape[0], step.width
        picked = x.index_select(0, step.src)
        if step.dest is None:
            padded = picked.view(groups, width, -1)
        else:
            padded = x.new_zeros(groups * width, x.shape[1])
            padded.index_copy_(0, step.dest, picked)
            padded = padded.view(groups, width, -1)
        delta = torch.bmm(torch.bmm(padded, a), b).view(groups * width, -1)
        if step.dest is not None:
            delta = delta.index_select(0, step.dest)
        return out.index_add_(0, step.src, delta)


TORCH_PRODUCTS = TorchProducts()


@dataclass(frozen=True, slots=True)
class TritonProducts:
    """On CUDA: both products and the add in one Triton launch (kernels/triton_lora.py)."""

    kernel: Callable[..., torch.Tensor]

    def __call__(
        self, layer: LoRALinear, x: torch.Tensor, out: torch.Tensor, step: LoRAStep
    ) -> torch.Tensor:
        return self.kernel(x, out, layer.a, layer.b, step.src, step.starts, step.slots, step.width)


@dataclass(frozen=True, slots=True)
class CpuProducts:
    """On a CPU: our kernel (csrc/cpu/lora.h) once its library for the dtype is loaded (it
    loads after start-up, on a thread); torch's products until then."""

    kernels: CpuKernels

    def __call__(
        self, layer: LoRALinear, x: torch.Tensor, out: torch.Tensor, step: LoRAStep
    ) -> torch.Tensor:
        lora_add = self.kernels.lora_add(x)
        if lora_add is None:
            return TORCH_PRODUCTS(layer, x, out, step)
        lora_add(
            x, out, layer.a, layer.b, step.src, step.starts, step.slots, layer.bounds, layer.rank
        )
        return out


class LoRASlots:
    """The slot pool: per (layer, fused projection) A [slots, in, K R] (its K modules' A side
    by side) and B [slots, K R, out] (block-diagonal: module k's B under its rows, over its
    output columns), zero where an adapter has no module or a smaller rank."""

    def __init__(
        self,
        arch: LlamaArchConfig,
        max_loras: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        shapes = module_shapes(arch)
        self.max_rank = max_rank
        self.a: dict[tuple[int, str], torch.Tensor] = {}
        self.b: dict[tuple[int, str], torch.Tensor] = {}
        self.columns: dict[str, list[tuple[str, int, int]]] = {}  # module, first column, width
        for fused, modules in FUSED.items():
            first, columns = 0, []
            for module in modules:
                columns.append((module, first, shapes[module][1]))
                first += shapes[module][1]
            self.columns[fused] = columns
            fan_in, ranks = shapes[modules[0]][0], max_rank * len(modules)
            for layer in range(arch.num_layers):
                self.a[layer, fused] = torch.zeros(
                    (max_loras, fan_in, ranks), dtype=dtype, device=device
                )
                self.b[layer, fused] = torch.zeros(
                    (max_loras, ranks, first), dtype=dtype, device=device
                )
        self.resident: list[str | None] = [None] * max_loras

    def bounds(self, fused: str) -> tuple[int, ...]:
        """Where each of `fused`'s modules' output columns begin, then its width."""
        columns = self.columns[fused]
        return (*(first for _, first, _ in columns), columns[-1][1] + columns[-1][2])

    def install(self, adapter: LoRAAdapter, slot: int) -> None:
        """Put `adapter` in `slot`: its modules' A and B, zeros for every other module."""
        for (layer, fused), a_stack in self.a.items():
            b_stack = self.b[layer, fused]
            a_stack[slot].zero_()
            b_stack[slot].zero_()
            for k, (module, first, width) in enumerate(self.columns[fused]):
                pair = adapter.weights.get((layer, module))
                if pair is None:
                    continue
                a, b = pair
                rows = slice(k * self.max_rank, k * self.max_rank + a.shape[1])
                a_stack[slot, :, rows].copy_(a)
                b_stack[slot, rows, first : first + width].copy_(b)
        self.resident[slot] = adapter.name


class LoRALinear(nn.Module):
    """A fused projection plus, for each token under an adapter, its low-rank update, run by
    the products chosen when it was wrapped."""

    def __init__(
        self,
        base: nn.Module,
        slots: LoRASlots,
        key: tuple[int, str],
        step: LoRAStep,
        products: LoRAProducts,
    ) -> None:
        super().__init__()
        self.base, self.step, self.products = base, step, products
        self.a, self.b = slots.a[key], slots.b[key]
        self.bounds, self.rank = slots.bounds(key[1]), slots.max_rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        if self.step.src is None:  # no adapter token in this step
            return out
        return self.products(self, x, out, self.step)


def wrap_projections(
    model: nn.Module, arch: LlamaArchConfig, slots: LoRASlots, products: LoRAProducts
) -> LoRAStep:
    """Wrap every fused projection of `model`'s layers; the step object they all read."""
    step = LoRAStep()
    layers: Any = model.model.layers  # type: ignore[union-attr]
    for index, layer in enumerate(layers):
        for owner, name in (
            (layer.self_attn, "qkv_proj"),
            (layer.self_attn, "o_proj"),
            (layer.mlp, "gate_up_proj"),
            (layer.mlp, "down_proj"),
        ):
            wrapped = LoRALinear(
                base=getattr(owner, name),
                slots=slots,
                key=(index, name),
                step=step,
                products=products,
            )
            setattr(owner, name, wrapped)
    return step
