"""bf16 products widened to float32 where this CPU's FMAs outrun its bf16 dot products: the
rates our library measures (csrc/cpu/dot_rates.cpp), the choice made from them; few rows on our
vector kernel over bf16 panels (csrc/cpu/linear_vectors_bf16.cpp), exact and refusing what it
does not handle; many rows over wide float32 copies within the memory limit; and a bf16 model
given both once our kernels are loaded."""

from __future__ import annotations

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
from blockserve.model import packed, weight_copies
from blockserve.model.packed import PackedLinear
from blockserve.model.weight_copies import pack_for_vectors, pack_wide, use_kernels, widening_pays
from blockserve.runner.build import build_runner
from tests.kernels import products
from tests.kernels.products import exact
from tests.tiny_models import save_tiny_model

BF16 = cpu_build.can_build(torch.bfloat16)


def small_ints(*shape: int, seed: int) -> torch.Tensor:
    return products.small_ints(*shape, seed=seed, dtype=torch.bfloat16)


class FakeOps:
    """The two things `widening_pays` asks our bf16 library."""

    def __init__(self, amx: bool, bf16: float, f32: float) -> None:
        self.amx, self.rates = amx, [bf16, f32]

    def has_amx(self) -> bool:
        return self.amx

    def dot_rates(self) -> list[float]:
        return self.rates


@pytest.mark.parametrize(
    ("amx", "bf16", "f32", "expected"),
    [
        (False, 84.0, 172.0, True),  # the AVX512-BF16 Xeon measured
        (False, 100.0, 125.0, True),  # WIDE_GAIN exactly
        (False, 100.0, 124.0, False),
        (False, 170.0, 85.0, False),  # a dot product issuing as often as an FMA
        (True, 84.0, 172.0, False),  # AMX tiles serve bf16 products there
    ],
)
def test_widening_is_chosen_by_the_rates_and_never_beside_amx(
    amx: bool, bf16: float, f32: float, expected: bool
) -> None:
    assert widening_pays(FakeOps(amx, bf16, f32)) is expected


@pytest.mark.skipif(not BF16, reason="needs an x86 CPU with AVX512-BF16 and g++ (our bf16 library)")
def test_the_library_measures_both_rates(kernels: CpuKernels) -> None:
    """Two rates of one core, each at least 1 GFLOP/s and below 64 FLOPs a cycle at 10 GHz: work
    the compiler elided (equal sums merged, a loop hoisted) would read as far more."""
    ops = kernels.loader.ops(torch.bfloat16)
    rates = ops.dot_rates()
    assert len(rates) == 2
    assert all(1.0 <= rate < 640.0 for rate in rates), rates


needs_library = pytest.mark.skipif(
    not BF16, reason="needs an x86 CPU with AVX512-BF16 and g++ (our bf16 library)"
)


@needs_library
@pytest.mark.parametrize("rows", [0, 1, 5, 15, 16, 17, 33, 63])
@pytest.mark.parametrize("bias", [False, True])
def test_the_vector_product_is_the_exact_one(kernels: CpuKernels, rows: int, bias: bool) -> None:
    """No rows, one pass of up to 16 rows, and passes of 16 with every kind of last one; 6
    panels of 16 columns shared by 2 threads; x a view (rows of a wider tensor), widened in
    blocks of 8 rows and 8 pairs of k: 85 pairs, 10 blocks and 5 pairs."""
    ops = kernels.loader.ops(torch.bfloat16)
    weight = small_ints(96, 170, seed=1)
    bias_value = small_ints(96, seed=2) if bias else None
    x = small_ints(rows, 2 * 170, seed=rows)[:, 170:]
    got = ops.vector_linear(x, ops.vector_pack(weight), bias_value)
    assert got.shape == (rows, 96) and got.dtype == torch.bfloat16
    assert torch.equal(got, exact(x, weight, bias_value))


@needs_library
def test_vector_packing_lays_each_panel_out_pair_after_pair_of_k(kernels: CpuKernels) -> None:
    """Column c of panel p at k = 2j + h lies at ((p * K / 2 + j) * 16 + c) * 2 + h: a 64-byte
    line per pair of k, as vdpbf16ps reads them."""
    ops = kernels.loader.ops(torch.bfloat16)
    weight = (torch.arange(64 * 48) % 251).view(64, 48).bfloat16()  # every value exact in bf16
    lines = ops.vector_pack(weight).view(64 // 16, 48 // 2, 16, 2)
    for p, i, c in ((0, 0, 0), (1, 47, 15), (3, 5, 3), (2, 30, 9)):
        assert lines[p, i // 2, c, i % 2] == weight[p * 16 + c, i]


def bf16(*shape: int) -> torch.Tensor:
    return torch.zeros(*shape, dtype=torch.bfloat16)


@needs_library
@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda o: o.vector_pack(bf16(64, 64).float()), "bfloat16"),
        (lambda o: o.vector_pack(bf16(48, 64)), "multiple of 32"),
        (lambda o: o.vector_pack(bf16(64, 63)), "columns even"),
        (lambda o: o.vector_pack(bf16(64)), "2-D"),
        (lambda o: o.vector_linear(bf16(2, 32), o.vector_pack(bf16(64, 64)), None), "columns"),
        (lambda o: o.vector_linear(bf16(2, 64).float(), o.vector_pack(bf16(64, 64)), None), "bf"),
        (lambda o: o.vector_linear(bf16(2, 64), o.vector_pack(bf16(64, 64)), bf16(32)), "bias"),
        (lambda o: o.vector_linear(bf16(2, 64), bf16(64, 128)[:, :64], None), "columns"),
        (lambda o: o.vector_linear(bf16(2, 64), bf16(48, 64), None), "multiple of 32"),
    ],
)
def test_the_vector_product_refuses_what_it_does_not_handle(
    kernels: CpuKernels, call: Callable[[Any], Any], message: str
) -> None:
    with pytest.raises(RuntimeError, match=message):
        call(kernels.loader.ops(torch.bfloat16))


def int_linear(in_features: int, out_features: int, seed: int) -> nn.Linear:
    return products.int_linear(in_features, out_features, seed=seed, dtype=torch.bfloat16)


def spy_on_dtypes(monkeypatch: pytest.MonkeyPatch) -> list[torch.dtype]:
    """The dtype of each product's rows oneDNN is handed (float32: a widened product)."""
    dtypes: list[torch.dtype] = []
    onednn = packed._packed_linear

    def spying(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        dtypes.append(x.dtype)
        return onednn(x, weight, bias)

    monkeypatch.setattr(packed, "_packed_linear", spying)
    return dtypes


@pytest.mark.skipif(
    not packed.can_prepack("cpu", torch.bfloat16),
    reason="oneDNN reorders bf16 weights only with AVX-512BW/VL/DQ or AVX-NE-CONVERT",
)
def test_products_of_many_rows_take_the_wide_copy_and_are_exact(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Within the memory limit (4 bytes a weight), each bf16 layer gets its wide copy; from
    `wide_min_rows` rows a product runs on it in float32, bias included, rounded to bf16 once:
    exact on integer operands; fewer rows, or products switched off, keep the bf16 weight."""
    first, second = int_linear(160, 96, seed=1), int_linear(96, 64, seed=3)
    weights = [(m.weight.detach().clone(), m.bias.detach().clone()) for m in (first, second)]
    model = nn.Sequential(PackedLinear(first), PackedLinear(second))
    kernels = CpuKernels()
    use_kernels(model, kernels)
    products.copies_may_take(monkeypatch, (160 * 96 + 96 * 64) * 4 - 1)
    assert pack_wide(model) == 0 and model[0].wide is None
    products.copies_may_take(monkeypatch, (160 * 96 + 96 * 64) * 4)
    assert pack_wide(model) == 2
    assert model[0].wide.dtype == torch.float32 and model[0].wide.shape == (96, 160)
    dtypes = spy_on_dtypes(monkeypatch)
    most = kernels.switches.wide_min_rows
    for rows in (most, most + 37, most - 1):
        x = small_ints(rows, 160, seed=rows)
        got = model(x)
        assert got.dtype == torch.bfloat16
        assert torch.equal(got, exact(exact(x, *weights[0]), *weights[1]))
    assert dtypes == [torch.float32] * 4 + [torch.bfloat16] * 2
    kernels.set_enabled(True, products=False)
    model(small_ints(most, 160, seed=9))
    assert dtypes[-2:] == [torch.bfloat16] * 2


@needs_library
def test_a_packed_linear_takes_vectors_below_the_wide_rows_and_the_wide_copy_from_them(
    kernels: CpuKernels, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With both copies, 1 to `wide_min_rows` - 1 rows run on our vector kernel, more on the
    wide copy, exact either way; a float32 build's panels are not taken for bf16 rows."""
    ops = kernels.loader.ops(torch.bfloat16)
    layer = int_linear(160, 96, seed=4)
    weight, bias = layer.weight.detach().clone(), layer.bias.detach().clone()
    model = nn.Sequential(PackedLinear(layer))
    use_kernels(model, kernels)
    assert pack_wide(model) == 1
    assert pack_for_vectors(model, ops, kernels.loader.isa(torch.bfloat16)) == 1
    vector_calls = products.spy_on_rows(monkeypatch, kernels, "vector_linear")
    dtypes = spy_on_dtypes(monkeypatch)
    most = kernels.switches.wide_min_rows
    for rows in (1, 16, most - 1, most):
        x = small_ints(rows, 160, seed=rows)
        assert torch.equal(model(x), exact(x, weight, bias))
    assert vector_calls == [1, 16, most - 1] and dtypes == [torch.float32]
    model[0].vectors_isa = "avx512"  # as if a float32 build had packed them
    model(small_ints(2, 160, seed=5))
    assert vector_calls == [1, 16, most - 1] and dtypes[-1] == torch.bfloat16


@needs_library
def test_a_layer_with_both_copies_drops_onednns_weight_and_runs_on_them(
    kernels: CpuKernels, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`pack_wide(drop_packed=True)`: a layer with its panels drops oneDNN's bf16 weight as its
    wide copy is made, one without them (out_features 40: no panels) keeps it; the dropped
    weight is still there to copy (the wide one narrowed back, exact), and every product stays
    exact, with ours switched off too (then oneDNN's over the wide copy)."""
    ops = kernels.loader.ops(torch.bfloat16)
    layers = [int_linear(160, 96, seed=11), int_linear(96, 40, seed=12)]
    weights = [(m.weight.detach().clone(), m.bias.detach().clone()) for m in layers]
    model = nn.Sequential(*(PackedLinear(m) for m in layers))
    use_kernels(model, kernels)
    assert pack_for_vectors(model, ops, kernels.loader.isa(torch.bfloat16)) == 1
    assert pack_wide(model, drop_packed=True) == 2
    assert model[0].packed is None and model[1].packed is not None
    assert torch.equal(model[0].dense_weight(), weights[0][0])
    dtypes = spy_on_dtypes(monkeypatch)
    most = kernels.switches.wide_min_rows
    for rows in (1, most - 1, most):
        x = small_ints(rows, 160, seed=rows)
        assert torch.equal(model(x), exact(exact(x, *weights[0]), *weights[1]))
    assert dtypes == [torch.bfloat16, torch.bfloat16, torch.float32, torch.float32]
    kernels.set_enabled(True, products=False)
    try:
        x = small_ints(3, 160, seed=13)
        assert torch.equal(model(x), exact(exact(x, *weights[0]), *weights[1]))
    finally:
        kernels.set_enabled(True)
    assert dtypes[-2:] == [torch.float32, torch.bfloat16]


@needs_library
@pytest.mark.parametrize("compiled", [False, True])
def test_a_compiled_forward_keeps_onednns_weight(
    kernels: CpuKernels, monkeypatch: pytest.MonkeyPatch, compiled: bool
) -> None:
    """Once the library loads where widening pays, a layer with both copies drops oneDNN's
    bf16 weight, unless the forward is compiled (its graphs read that weight)."""
    monkeypatch.setattr(weight_copies, "widening_pays", lambda ops: True)
    monkeypatch.setattr(weight_copies, "halving_pays", lambda ops: False)
    monkeypatch.setattr(CpuKernels, "use_wide_attention", lambda self, on: on)
    model = nn.Sequential(PackedLinear(int_linear(64, 32, seed=14)))
    use_kernels(model, kernels)
    pack = weight_copies.pack_once_loaded(weakref.ref(model), kernels, torch.bfloat16, compiled)
    pack(kernels.loader.ops(torch.bfloat16))
    layer = model[0]
    assert layer.vectors is not None and layer.wide is not None
    assert (layer.packed is None) is not compiled


@needs_library
def test_silu_of_float32_sums_gives_the_bits_of_the_rounded_product(kernels: CpuKernels) -> None:
    """SiLU(gate) · up of a widened product's float32 sums, rounded as they are read, is
    silu_and_mul of the sums rounded to bf16, to the bit (ties to even included; rows of a
    wider tensor); it takes float32 sums only."""
    ops = kernels.loader.ops(torch.bfloat16)
    generator = torch.Generator().manual_seed(6)
    sums = (torch.randn(37, 400, generator=generator) * 4)[:, :192]
    sums[0, :4] = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 2 + 2**-7])  # ties
    got = ops.silu_and_mul_sums(sums)
    assert got.dtype == torch.bfloat16 and got.shape == (37, 96)
    assert torch.equal(got, ops.silu_and_mul(sums.bfloat16()))
    with pytest.raises(RuntimeError, match="float32"):
        ops.silu_and_mul_sums(sums.bfloat16())


@needs_library
def test_a_widened_gate_up_product_hands_silu_its_float32_sums(kernels: CpuKernels) -> None:
    """From `wide_min_rows` rows the MLP's gate/up product hands SiLU its float32 sums (no
    bf16 product written), with the bits of SiLU over the product; fewer rows run the
    product, then SiLU."""
    ops = kernels.loader.ops(torch.bfloat16)
    layer = int_linear(160, 64, seed=7)
    layer.bias = None
    gate_up = PackedLinear(layer)
    gate_up.kernels = kernels
    assert pack_wide(nn.Sequential(gate_up)) == 1

    most = kernels.switches.wide_min_rows
    generator = torch.Generator().manual_seed(8)
    for rows in (most, most - 1):
        expected = "silu_and_mul_sums" if rows == most else "silu_and_mul"
        assert products.silu_operators(gate_up, ops, rows, generator) == [expected]


@needs_library
def test_a_bf16_model_gets_its_copies_where_widening_pays(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once the runner's bf16 kernels are loaded, where widening pays (here told it does: the
    AMX hosts' tiles come first otherwise) and half precision does not, every linear layer of
    a tiny Llama has its wide copy and each one the vector kernel takes its panels (and drops
    oneDNN's bf16 weight), and attention is widened; where it does not, none of that. A
    decode's MLP (8 rows) runs on the vectors, a prefill's (`wide_min_rows`) on the wide
    copies, both within bf16 rounding of oneDNN's."""
    model_dir = save_tiny_model(
        tmp_path, hidden_size=128, intermediate_size=256, num_attention_heads=2,
        num_key_value_heads=1,
    )  # fmt: skip
    copies, widened_attention = {}, []
    monkeypatch.setattr(  # as the engine sets it, without leaving it set for later tests
        CpuKernels, "use_wide_attention", lambda self, on: widened_attention.append(on) or on
    )
    monkeypatch.setattr(weight_copies, "halving_pays", lambda ops: False)  # test_half_products.py
    for pays in (True, False):
        monkeypatch.setattr(weight_copies, "widening_pays", lambda ops, pays=pays: pays)
        runner = build_runner(
            ModelConfig(model=str(model_dir), dtype="bfloat16"),
            CacheConfig(num_gpu_blocks_override=16),
        )
        assert runner.kernels.loader.wait(timeout=600)
        linears = [m for m in runner.model.modules() if isinstance(m, PackedLinear)]
        copies[pays] = [
            (m.wide is not None, m.vectors is not None, m.packed is None) for m in linears
        ]
    panels = [m.out_features % 32 == 0 for m in linears]
    assert copies == {
        True: [(True, p, p) for p in panels],  # oneDNN's weight dropped beside both copies
        False: [(False, False, False)] * len(linears),
    }
    assert widened_attention == [True]  # attention widened where the products are
    mlp: Any = runner.model.model.layers[0].mlp
    runner.kernels.switches.tiles = False  # an AMX host's tile copies would serve first
    pack_wide(runner.model)
    pack_for_vectors(
        runner.model,
        runner.kernels.loader.ops(torch.bfloat16),
        runner.kernels.loader.isa(torch.bfloat16),
    )
    vector_calls = products.spy_on_rows(monkeypatch, runner.kernels, "vector_linear")
    for rows in (8, runner.kernels.switches.wide_min_rows):
        hidden = torch.randn(rows, 128, generator=torch.Generator().manual_seed(rows)).bfloat16()
        layer_ops = runner.kernels.layer_ops(hidden, head_dim=64)
        with torch.inference_mode():
            ours = mlp(hidden, layer_ops)
            runner.kernels.set_enabled(True, products=False)
            try:
                dtypes = spy_on_dtypes(monkeypatch)
                onednn = mlp(hidden, layer_ops)
                assert dtypes == [torch.bfloat16, torch.bfloat16]  # gate_up, down
            finally:
                runner.kernels.set_enabled(True)
        torch.testing.assert_close(ours, onednn, rtol=2**-7, atol=2**-7)
    assert vector_calls == [8, 8]
