"""Our CPU kernel of LoRA's grouped products (csrc/cpu/lora.h) in every library build the host
runs: on integer operands, whose float32 sums are exact, it equals the float64 products bit for
bit (bf16 rounded once, as torch rounds); tails of every kind; other rows and the stacks'
off-diagonal blocks untouched; refusals before anything is written; and an engine using it
gives transformers + peft's tokens and logprobs."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from blockserve import LoRARequest
from blockserve.kernels import CpuKernels
from blockserve.kernels import build as cpu_build
from blockserve.lora import manager
from blockserve.lora.layers import CpuProducts
from tests.kernels.products import small_ints
from tests.lora.test_lora import GREEDY, PROMPTS, make_llm, reference

BUILDS = [
    (dtype, target.isa) for dtype in (torch.float32, torch.bfloat16)
    for target in cpu_build.runnable(dtype)
]  # fmt: skip
pytestmark = pytest.mark.skipif(
    not cpu_build.can_build(torch.float32),
    reason="needs an x86 CPU with AVX2 and FMA, and g++ (elsewhere torch's bmm serves LoRA)",
)
BOUNDS = [0, 67, 87, 119]  # three modules: tails of 3, 4 and 0 + 2 vectors of columns
RANK = 8  # ranks 24: one vector and a tail
SLOTS = 4


@pytest.fixture(scope="module", params=BUILDS or [(torch.float32, "none")], ids=str)
def build(
    request: pytest.FixtureRequest, kernels: CpuKernels, cpu_kernels_dir: Path
) -> Iterator[tuple[torch.dtype, Any]]:
    dtype, isa = request.param
    ops = kernels.loader.load(cpu_kernels_dir, dtype, isa)
    assert ops is not None and kernels.loader.isa(dtype) == isa
    yield dtype, ops
    kernels.loader.load(cpu_kernels_dir, dtype, cpu_build.runnable(dtype)[0].isa)


def stacks(dtype: torch.dtype, fan_in: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A [S, in, K R] and B [S, K R, width]; B's off-diagonal blocks hold values the kernel
    must not read."""
    a = small_ints(SLOTS, fan_in, 3 * RANK, seed=1, dtype=dtype)
    b = small_ints(SLOTS, 3 * RANK, BOUNDS[-1], seed=2, dtype=dtype)
    return a, b


def expected(
    x: torch.Tensor, out: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
    groups: list[tuple[int, list[int]]],
) -> torch.Tensor:  # fmt: skip
    """`out` plus each group's products in float64, module by module, rounded once."""
    result = out.double()
    for slot, rows in groups:
        shrunk = x[rows].double() @ a[slot].double()
        for k in range(len(BOUNDS) - 1):
            ranks, columns = slice(k * RANK, (k + 1) * RANK), slice(BOUNDS[k], BOUNDS[k + 1])
            result[rows, columns] += shrunk[:, ranks] @ b[slot, ranks, columns].double()
    return result.to(out.dtype)


def run(ops: Any, x: torch.Tensor, out: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
        groups: list[tuple[int, list[int]]]) -> None:  # fmt: skip
    src = torch.tensor([row for _, rows in groups for row in rows], dtype=torch.int64)
    sizes = [len(rows) for _, rows in groups]
    starts = torch.tensor([sum(sizes[:g]) for g in range(len(sizes) + 1)], dtype=torch.int64)
    slots = torch.tensor([slot for slot, _ in groups], dtype=torch.int64)
    ops.lora_add_(x, out, a, b, src, starts, slots, BOUNDS, RANK)


@pytest.mark.parametrize("fan_in", [16, 80])
def test_grouped_products_are_exact(build: tuple[torch.dtype, Any], fan_in: int) -> None:
    """Groups of 11, 1, 0, 9 and 2 tokens (whole tiles and tiles of 1, 2 and 4 in either
    build) on slots 2, 0, 1, 3 and 1 again, rows out of order; rows of no group keep their
    values bit for bit."""
    dtype, ops = build
    a, b = stacks(dtype, fan_in)
    x = small_ints(40, 2 * fan_in, seed=3, dtype=dtype)[:, fan_in:]  # rows of a wider tensor
    out = small_ints(40, BOUNDS[-1], seed=4, dtype=dtype)
    order = torch.randperm(40, generator=torch.Generator().manual_seed(5)).tolist()
    groups = [(2, order[:11]), (0, order[11:12]), (1, []), (3, order[12:21]), (1, order[21:23])]
    want = expected(x, out, a, b, groups)
    run(ops, x, out, a, b, groups)
    assert torch.equal(out, want)
    assert torch.equal(out[order[23:]], small_ints(40, BOUNDS[-1], seed=4, dtype=dtype)[order[23:]])


def test_no_groups_change_nothing(build: tuple[torch.dtype, Any]) -> None:
    dtype, ops = build
    a, b = stacks(dtype, 16)
    out = small_ints(5, BOUNDS[-1], seed=4, dtype=dtype)
    run(ops, small_ints(5, 16, seed=3, dtype=dtype), out, a, b, [])
    assert torch.equal(out, small_ints(5, BOUNDS[-1], seed=4, dtype=dtype))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"slot": SLOTS}, "slots must index a"),
        ({"row": 5}, "src must index x's rows"),
        ({"bounds": [0, 67, 87, 118]}, "bounds must run from 0 to out's width"),
        ({"rank": 7}, "bounds must run from 0 to out's width"),
        ({"dtype": torch.float16}, "CPU tensors of the library's type"),
    ],
)
def test_bad_arguments_are_refused_before_any_write(
    build: tuple[torch.dtype, Any], change: dict[str, Any], message: str
) -> None:
    dtype, ops = build
    a, b = stacks(dtype, 16)
    x = small_ints(5, 16, seed=3, dtype=change.get("dtype", dtype))
    out = small_ints(5, BOUNDS[-1], seed=4, dtype=dtype)
    src = torch.tensor([0, 1, change.get("row", 2)], dtype=torch.int64)
    starts = torch.tensor([0, 2, 3], dtype=torch.int64)
    slots = torch.tensor([1, change.get("slot", 0)], dtype=torch.int64)
    with pytest.raises(RuntimeError, match=message):
        ops.lora_add_(x, out, a, b, src, starts, slots, change.get("bounds", BOUNDS),
                      change.get("rank", RANK))  # fmt: skip
    assert torch.equal(out, small_ints(5, BOUNDS[-1], seed=4, dtype=dtype))


@pytest.mark.slow
def test_an_engine_on_our_kernel_equals_peft(
    tiny_llama_dir: Path,
    adapters: dict[str, Path],
    kernels: CpuKernels,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The mixed batch of test_lora.py through our float32 kernel (the tiny model's heads are
    too small for the rest of our kernels, so the runner does not load them itself: the
    engine's products are built over the session's loaded kernels instead)."""
    monkeypatch.setattr(manager, "lora_products", lambda device, _: CpuProducts(kernels))
    llm = make_llm(tiny_llama_dir, max_loras=2)
    served: list[bool] = []  # whether each projection's call found the kernel loaded
    lora_add = kernels.lora_add

    def counted(x: torch.Tensor) -> Any:
        served.append(lora_add(x) is not None)
        return lora_add(x)

    kernels.lora_add = counted  # type: ignore[method-assign]
    try:
        loras = [None, LoRARequest("every", 1, str(adapters["every"])),
                 LoRARequest("qv", 2, str(adapters["qv"]))]  # fmt: skip
        prompts = [{"prompt_token_ids": p} for p in PROMPTS for _ in loras]
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras * 2)
    finally:
        del kernels.lora_add
    assert served and all(served)
    for output, prompt, lora in zip(outputs, [p for p in PROMPTS for _ in loras], loras * 2,
                                    strict=True):  # fmt: skip
        tokens, logprobs = reference(tiny_llama_dir, adapters[lora.lora_name] if lora else None,
                                     prompt)  # fmt: skip
        assert list(output.outputs[0].token_ids) == tokens
        got = [lp.logprob for lp in output.outputs[0].logprobs or ()]
        assert got == pytest.approx(logprobs, abs=1e-4)
