"""bf16 products of many rows in half precision where the CPU has AVX512-FP16 and no AMX
(csrc/cpu/linear_f16.cpp): the choice, the packing, exact sums on small integers, sums off
float64's by less than a bf16 rounding on real-valued operands at any scale, what the kernel
refuses, and a layer and a model that take the half copies from `half_min_rows` rows."""

from __future__ import annotations

import subprocess
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from blockserve.config import CacheConfig, ModelConfig
from blockserve.kernels import CpuKernels
from blockserve.kernels import build as cpu_build
from blockserve.model import weight_copies
from blockserve.model.packed import PackedLinear
from blockserve.model.weight_copies import (
    HALF_PRODUCTS_ENV,
    halving_pays,
    pack_for_vectors,
    pack_halves,
    use_kernels,
)
from blockserve.runner.build import build_runner
from tests.kernels import products
from tests.kernels.products import exact
from tests.tiny_models import save_tiny_model


def compiler_has_half() -> bool:
    """Whether the g++ that builds our library has AVX512-FP16's intrinsics (12 or later)."""
    found = subprocess.run(["g++", "-dumpversion"], capture_output=True, text=True, check=False)
    return found.returncode == 0 and int(found.stdout.split(".")[0]) >= 12


CPU_HALF = bool(torch.cpu.get_capabilities().get("avx512_fp16"))
HALF = cpu_build.can_build(torch.bfloat16) and CPU_HALF and compiler_has_half()
needs_half = pytest.mark.skipif(
    not HALF,
    reason="needs an x86 CPU with AVX512-BF16 and AVX512-FP16, and g++ 12 or later (our library)",
)


def small_ints(*shape: int, seed: int) -> torch.Tensor:
    return products.small_ints(*shape, seed=seed, dtype=torch.bfloat16)


class FakeOps:
    """The two things `halving_pays` asks our bf16 library."""

    def __init__(self, amx: bool, half: bool) -> None:
        self.amx, self.half = amx, half

    def has_amx(self) -> bool:
        return self.amx

    def has_half(self) -> bool:
        return self.half


@pytest.mark.parametrize(
    ("amx", "half", "env", "expected"),
    [
        (False, True, None, True),  # the AVX512-FP16 Xeon without AMX measured
        (False, True, "1", True),
        (False, True, "0", False),  # switched off: widened to float32 instead
        (False, False, None, False),  # no AVX512-FP16 (an EPYC's AVX512-BF16)
        (True, True, None, False),  # AMX tiles serve bf16 products there
    ],
)
def test_half_precision_is_chosen_by_the_cpu_and_the_environment(
    monkeypatch: pytest.MonkeyPatch, amx: bool, half: bool, env: str | None, expected: bool
) -> None:
    if env is None:
        monkeypatch.delenv(HALF_PRODUCTS_ENV, raising=False)
    else:
        monkeypatch.setenv(HALF_PRODUCTS_ENV, env)
    assert halving_pays(FakeOps(amx, half)) is expected


@pytest.mark.skipif(not cpu_build.can_build(torch.bfloat16), reason="needs our bf16 library")
def test_the_library_says_whether_the_cpu_has_avx512_fp16(kernels: CpuKernels) -> None:
    """Yes where the CPU has it and the compiler that built the library knew it."""
    ops = kernels.loader.ops(torch.bfloat16)
    assert ops.has_half() is (CPU_HALF and compiler_has_half())


@needs_half
def test_packing_scales_each_column_by_a_power_of_two_and_lays_out_pairs_of_k(
    kernels: CpuKernels,
) -> None:
    """Column c's scale is the power of two just above its largest magnitude (1 for a zero
    column); the halves of W / scale lie at ((b * K / 2 + j) * 64 + c % 64) * 2 + h for
    k = 2j + h, b = c / 64: one 256-byte line a pair."""
    ops = kernels.loader.ops(torch.bfloat16)
    weight = ((torch.arange(128 * 64) % 251) - 125).view(128, 64).bfloat16()
    weight[5] = 0
    weight[6] *= 2**-20  # small: scaled up into the halves' range
    halves, scales = ops.half_pack(weight)
    assert halves.dtype == torch.float16 and scales.dtype == torch.float32
    largest = weight.float().abs().amax(dim=1)
    assert scales[5] == 1.0
    nonzero = largest > 0
    assert torch.equal(scales[nonzero], torch.exp2(torch.floor(torch.log2(largest[nonzero])) + 1))
    lines = halves.view(2, 32, 64, 2)
    for col, k in ((0, 0), (6, 7), (70, 63), (127, 30), (5, 9)):
        expected = weight[col, k].float() / scales[col]
        assert lines[col // 64, k // 2, col % 64, k % 2].float() == expected


@needs_half
@pytest.mark.parametrize("rows", [0, 1, 5, 6, 7, 13, 48, 100])
@pytest.mark.parametrize("bias", [False, True])
def test_the_half_product_is_exact_on_small_integers(
    kernels: CpuKernels, rows: int, bias: bool
) -> None:
    """Integers in [-2, 2] scaled by 4 are exact in half precision, and so is every sum of 32
    of their products: the kernel's result is the exact one. No rows, micro tiles of 6 with
    every kind of last one, 2 blocks of 64 columns shared by 2 threads, 80 pairs of k (runs
    of 32, 32 and 16), x a view (rows of a wider tensor)."""
    ops = kernels.loader.ops(torch.bfloat16)
    weight = small_ints(128, 160, seed=1)
    bias_value = small_ints(128, seed=2) if bias else None
    x = small_ints(rows, 2 * 160, seed=rows)[:, 160:]
    halves, scales = ops.half_pack(weight)
    got = ops.half_linear(x, halves, scales, bias_value)
    assert got.shape == (rows, 128) and got.dtype == torch.bfloat16
    assert torch.equal(got, exact(x, weight, bias_value))
    sums = ops.half_linear_sums(x, halves, scales)
    assert sums.dtype == torch.float32
    assert torch.equal(sums, (x.double() @ weight.double().T).float())


@needs_half
def test_half_sums_are_off_float64s_by_less_than_a_bf16_rounding_at_any_scale(
    kernels: CpuKernels,
) -> None:
    """Real-valued operands, an outlier channel, rows of magnitude 2^13 and 2^-20 (past half
    precision's range either way unscaled), 1,536 of k: every sum within 2^-9 of the sum of
    its terms' magnitudes (32 roundings of 2^-11 of the running sum at worst; 0.78 · 2^-11
    measured), and the error's root mean square at most 0.8 of that of rounding the exact
    sums to bf16, over all rows and over each scaled one (0.44-0.66 measured)."""
    ops = kernels.loader.ops(torch.bfloat16)
    generator = torch.Generator().manual_seed(3)
    weight = (torch.randn(192, 1536, generator=generator) * 0.05).bfloat16()
    x = torch.randn(64, 1536, generator=generator)
    x[:, 7] *= 40
    x[3] *= 2**13
    x[4] *= 2**-20
    x = x.bfloat16()
    halves, scales = ops.half_pack(weight)
    sums = ops.half_linear_sums(x, halves, scales).double()
    reference = x.double() @ weight.double().T
    magnitude = x.double().abs() @ weight.double().abs().T
    error = (sums - reference).abs()
    assert bool((error <= 2**-9 * magnitude).all())
    rounding = (reference.bfloat16().double() - reference).abs()
    for rows in (slice(0, 64), slice(3, 4), slice(4, 5)):  # all, the large row, the small one
        ratio = error[rows].pow(2).mean().sqrt() / rounding[rows].pow(2).mean().sqrt()
        assert ratio <= 0.8, (rows, ratio)


@needs_half
def test_a_row_of_zeros_gives_zeros_and_a_nan_stays_in_its_row(kernels: CpuKernels) -> None:
    ops = kernels.loader.ops(torch.bfloat16)
    weight = small_ints(64, 64, seed=4)
    x = small_ints(3, 64, seed=5)
    x[0] = 0
    x[1, 9] = float("nan")
    halves, scales = ops.half_pack(weight)
    got = ops.half_linear(x, halves, scales, None)
    assert torch.equal(got[0], torch.zeros(64, dtype=torch.bfloat16))
    assert bool(got[1].isnan().all())
    assert torch.equal(got[2], exact(x[2:], weight, None)[0])


def bf16(*shape: int) -> torch.Tensor:
    return torch.zeros(*shape, dtype=torch.bfloat16)


def packed_zeros(ops: Any, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    return ops.half_pack(bf16(n, k))


@needs_half
@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda o: o.half_pack(bf16(64, 64).float()), "bfloat16"),
        (lambda o: o.half_pack(bf16(96, 64)), "multiple of"),
        (lambda o: o.half_pack(bf16(64, 48)), "multiple of"),
        (lambda o: o.half_pack(bf16(64)), "2-D"),
        (lambda o: o.half_linear(bf16(2, 32), *packed_zeros(o, 64, 64), None), "columns"),
        (lambda o: o.half_linear(bf16(2, 64).float(), *packed_zeros(o, 64, 64), None), "bf"),
        (lambda o: o.half_linear(bf16(2, 64), *packed_zeros(o, 64, 64), bf16(32)), "bias"),
        (lambda o: o.half_linear(bf16(64, 2).T, *packed_zeros(o, 64, 64), None), "unit"),
        (
            lambda o: o.half_linear(bf16(2, 64), packed_zeros(o, 64, 64)[0], bf16(64)),
            "scales",
        ),
        (
            lambda o: o.half_linear(bf16(2, 64), bf16(64, 64), packed_zeros(o, 64, 64)[1], None),
            "packed weight",
        ),
    ],
)
def test_the_half_product_refuses_what_it_does_not_handle(
    kernels: CpuKernels, call: Callable[[Any], Any], message: str
) -> None:
    with pytest.raises(RuntimeError, match=message):
        call(kernels.loader.ops(torch.bfloat16))


def int_linear(in_features: int, out_features: int, seed: int) -> nn.Linear:
    return products.int_linear(in_features, out_features, seed=seed, dtype=torch.bfloat16)


@needs_half
def test_a_packed_linear_takes_the_half_copy_from_half_min_rows(
    kernels: CpuKernels, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Within the memory limit (2 bytes a weight of the layers it takes) each layer of 64
    columns gets its half copy (one of 40 does not); with the panels too, fewer than
    `half_min_rows` rows run on our vector kernel, more in half precision, exact either way;
    products switched off run oneDNN's."""
    ops = kernels.loader.ops(torch.bfloat16)
    layers = [int_linear(160, 128, seed=4), int_linear(128, 40, seed=5)]
    weights = [(m.weight.detach().clone(), m.bias.detach().clone()) for m in layers]
    model = nn.Sequential(*(PackedLinear(m) for m in layers))
    use_kernels(model, kernels)
    products.copies_may_take(monkeypatch, 160 * 128 * 2 - 1)
    assert pack_halves(model, ops) == 0 and model[0].halves is None
    products.copies_may_take(monkeypatch, 160 * 128 * 2)
    assert pack_halves(model, ops) == 1 and model[1].halves is None
    assert pack_for_vectors(model, ops, kernels.loader.isa(torch.bfloat16)) == 1
    half_calls = products.spy_on_rows(monkeypatch, kernels, "half_linear")
    vector_calls = products.spy_on_rows(monkeypatch, kernels, "vector_linear")
    least = kernels.switches.half_min_rows
    for rows in (1, least - 1, least, least + 37):
        x = small_ints(rows, 160, seed=rows)
        assert torch.equal(model(x), exact(exact(x, *weights[0]), *weights[1]))
    assert half_calls == [least, least + 37]
    assert vector_calls == [1, least - 1]
    kernels.set_enabled(True, products=False)
    try:
        x = small_ints(least, 160, seed=9)
        assert torch.equal(model(x), exact(exact(x, *weights[0]), *weights[1]))
    finally:
        kernels.set_enabled(True)
    assert half_calls == [least, least + 37]


@needs_half
def test_a_gate_up_product_in_half_precision_hands_silu_its_float32_sums(
    kernels: CpuKernels,
) -> None:
    """From `half_min_rows` rows the MLP's gate/up product hands SiLU its float32 sums (no
    bf16 product written), with the bits of SiLU over the product; fewer rows run the
    product (oneDNN's here: no panels), then SiLU."""
    ops = kernels.loader.ops(torch.bfloat16)
    layer = int_linear(160, 128, seed=7)
    layer.bias = None
    gate_up = PackedLinear(layer)
    gate_up.kernels = kernels
    assert pack_halves(nn.Sequential(gate_up), ops) == 1

    least = kernels.switches.half_min_rows
    generator = torch.Generator().manual_seed(8)
    for rows in (least, least - 1):
        expected = "silu_and_mul_sums" if rows == least else "silu_and_mul"
        assert products.silu_operators(gate_up, ops, rows, generator) == [expected]


@needs_half
def test_a_bf16_model_gets_half_copies_where_half_precision_pays(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once the runner's bf16 kernels are loaded where widening and half precision pay (told
    so: an AMX host's tiles come first otherwise), every linear layer of a tiny Llama has its
    half copy and its panels, no wide copy, and keeps oneDNN's weight; a prefill's MLP
    (`half_min_rows` rows) runs in half precision within bf16 rounding of oneDNN's."""
    model_dir = save_tiny_model(
        tmp_path, hidden_size=128, intermediate_size=256, num_attention_heads=2,
        num_key_value_heads=1,
    )  # fmt: skip
    monkeypatch.setattr(weight_copies, "widening_pays", lambda ops: True)
    monkeypatch.setattr(weight_copies, "halving_pays", lambda ops: True)
    monkeypatch.setattr(CpuKernels, "use_wide_attention", lambda self, on: on)
    runner = build_runner(
        ModelConfig(model=str(model_dir), dtype="bfloat16"),
        CacheConfig(num_gpu_blocks_override=16),
    )
    assert runner.kernels.loader.wait(timeout=600)
    linears = [m for m in runner.model.modules() if isinstance(m, PackedLinear)]
    copies = [
        (m.halves is not None, m.vectors is not None, m.wide is None, m.packed is not None)
        for m in linears
    ]
    assert copies == [(m.halvable(), m.vectorizable(), True, True) for m in linears]
    assert sum(m.halves is not None for m in linears) >= 4  # q, o, gate/up, down at least
    mlp: Any = runner.model.model.layers[0].mlp
    runner.kernels.switches.tiles = False  # an AMX host's tile copies would serve first
    half_calls = products.spy_on_rows(monkeypatch, runner.kernels, "half_linear_sums")
    rows = runner.kernels.switches.half_min_rows
    hidden = torch.randn(rows, 128, generator=torch.Generator().manual_seed(rows)).bfloat16()
    layer_ops = runner.kernels.layer_ops(hidden, head_dim=64)
    with torch.inference_mode():
        ours = mlp(hidden, layer_ops)
        runner.kernels.set_enabled(True, products=False)
        try:
            onednn = mlp(hidden, layer_ops)
        finally:
            runner.kernels.set_enabled(True)
    assert half_calls == [rows]  # gate/up; down runs half_linear
    torch.testing.assert_close(ours, onednn, rtol=2**-6, atol=2**-6)


@needs_half
def test_pack_once_loaded_makes_half_copies_in_place_of_wide_ones(
    kernels: CpuKernels, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(weight_copies, "widening_pays", lambda ops: True)
    monkeypatch.setattr(weight_copies, "halving_pays", lambda ops: True)
    monkeypatch.setattr(CpuKernels, "use_wide_attention", lambda self, on: on)
    model = nn.Sequential(PackedLinear(int_linear(64, 64, seed=14)))
    use_kernels(model, kernels)
    pack = weight_copies.pack_once_loaded(weakref.ref(model), kernels, torch.bfloat16)
    pack(kernels.loader.ops(torch.bfloat16))
    layer = model[0]
    assert layer.halves is not None and layer.vectors is not None
    assert layer.wide is None and layer.packed is not None
