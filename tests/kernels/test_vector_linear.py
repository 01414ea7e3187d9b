"""Our float32 products of few rows (csrc/cpu/linear_f32.cpp), in each build of the f32
library the host runs, and the `PackedLinear` path to them: exact where the float32 sums are,
refusing what they do not handle, taken for up to `VECTOR_MAX_ROWS` rows of a layer whose
copy the loaded build made (oneDNN's products otherwise), and the copies made for a float32
model once our kernels are loaded."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from blockserve.config import CacheConfig, ModelConfig
from blockserve.kernels import CpuKernels
from blockserve.kernels import build as cpu_build
from blockserve.model.packed import PackedLinear
from blockserve.model.weight_copies import pack_for_vectors, use_kernels
from blockserve.runner.build import build_runner
from tests.kernels import products
from tests.kernels.products import exact
from tests.tiny_models import save_tiny_model

BUILDS = [target.isa for target in cpu_build.runnable(torch.float32)]
pytestmark = pytest.mark.skipif(
    not cpu_build.can_build(torch.float32),
    reason="needs an x86 CPU with AVX2 and FMA, and g++ (elsewhere oneDNN serves every product)",
)


@pytest.fixture(scope="module", params=BUILDS or ["none"])
def isa(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def ops(kernels: CpuKernels, cpu_kernels_dir: Path, isa: str) -> Iterator[Any]:
    loaded = kernels.loader.load(cpu_kernels_dir, torch.float32, isa)
    assert loaded is not None and kernels.loader.isa(torch.float32) == isa
    yield loaded
    kernels.loader.load(cpu_kernels_dir, torch.float32, BUILDS[0])  # the widest, as served


def small_ints(*shape: int, seed: int) -> torch.Tensor:
    return products.small_ints(*shape, seed=seed, dtype=torch.float32)


@pytest.mark.parametrize("rows", [0, 1, 5, 6, 7, 12, 13, 25, 64, 100])
@pytest.mark.parametrize("bias", [False, True])
def test_the_product_is_the_exact_one(ops: Any, rows: int, bias: bool) -> None:
    """No rows, passes of 6 or 12 rows and every kind of last pass (a pass is 6 rows in the
    AVX2 build, 12 in the AVX-512F one); 3 or 6 panels shared by 2 threads."""
    weight = small_ints(96, 160, seed=1)
    bias_value = small_ints(96, seed=2) if bias else None
    x = small_ints(rows, 2 * 160, seed=rows)[:, 160:]  # rows of a wider tensor: a view
    got = ops.vector_linear(x, ops.vector_pack(weight), bias_value)
    assert got.shape == (rows, 96) and got.dtype == torch.float32
    assert torch.equal(got, exact(x, weight, bias_value))


def test_packing_lays_each_panel_out_row_after_row_of_k(ops: Any, isa: str) -> None:
    """Column c of panel p, row i of k at (p * K + i) * panel + c: a panel is 2 vectors of
    columns (16 in the AVX2 build, 32 in the AVX-512F one)."""
    width = {"avx2": 16, "avx512": 32}[isa]
    weight = torch.arange(64 * 48, dtype=torch.float32).view(64, 48)
    panels = ops.vector_pack(weight).view(64 // width, 48, width)
    for p, i, c in ((0, 0, 0), (1, 47, width - 1), (64 // width - 1, 5, 3)):
        assert panels[p, i, c] == weight[p * width + c, i]


def f32(*shape: int) -> torch.Tensor:
    return torch.zeros(*shape)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda o: o.vector_pack(f32(64, 64).bfloat16()), "float32"),
        (lambda o: o.vector_pack(f32(48, 64)), "multiple of 32"),
        (lambda o: o.vector_pack(f32(64)), "2-D"),
        (lambda o: o.vector_linear(f32(2, 32), o.vector_pack(f32(64, 64)), None), "columns"),
        (
            lambda o: o.vector_linear(f32(2, 64).double(), o.vector_pack(f32(64, 64)), None),
            "float32",
        ),
        (lambda o: o.vector_linear(f32(2, 64), o.vector_pack(f32(64, 64)), f32(32)), "bias"),
        (lambda o: o.vector_linear(f32(2, 64), f32(64, 128)[:, :64], None), "columns"),
        (lambda o: o.vector_linear(f32(2, 64), f32(48, 64), None), "multiple of 32"),
    ],
)
def test_refuses_what_it_does_not_handle(ops: Any, call: Callable[[Any], Any], message: str):
    with pytest.raises(RuntimeError, match=message):
        call(ops)


def int_linear(in_features: int, out_features: int, seed: int) -> nn.Linear:
    return products.int_linear(in_features, out_features, seed, torch.float32)


@pytest.fixture
def vector_calls(monkeypatch: pytest.MonkeyPatch, kernels: CpuKernels) -> list[int]:
    """The rows of each product the vector kernel was handed."""
    return products.spy_on_rows(monkeypatch, kernels, "vector_linear")


def test_a_packed_linear_takes_the_vectors_for_few_rows_of_its_build_only(
    kernels: CpuKernels, ops: Any, isa: str, cpu_kernels_dir: Path, vector_calls: list[int]
) -> None:
    linear = int_linear(160, 96, seed=3)
    weight, bias = linear.weight.detach().clone(), linear.bias.detach().clone()
    layer = PackedLinear(linear)
    use_kernels(layer, kernels)
    assert layer.vectors is None
    most = kernels.switches.vector_max_rows
    x = small_ints(most + 1, 160, seed=4)
    assert torch.equal(layer(x[:3]), exact(x[:3], weight, bias)) and vector_calls == []

    assert pack_for_vectors(layer, ops, isa) == 1 and layer.vectors_isa == isa
    for rows in (1, most, most + 1):
        assert torch.equal(layer(x[:rows]), exact(x[:rows], weight, bias))
    assert torch.equal(layer(x[:6].view(2, 3, 160)), exact(x[:6], weight, bias).view(2, 3, 96))
    assert vector_calls == [1, most, 6]  # more rows: oneDNN's product

    kernels.set_enabled(True, products=False)  # oneDNN's products, the other kernels ours
    try:
        assert torch.equal(layer(x[:3]), exact(x[:3], weight, bias))
    finally:
        kernels.set_enabled(True)
    for other in BUILDS:  # another build loaded: its panels are not this one's
        if other != isa:
            assert kernels.loader.load(cpu_kernels_dir, torch.float32, other) is not None
            assert torch.equal(layer(x[:3]), exact(x[:3], weight, bias))
            assert kernels.loader.load(cpu_kernels_dir, torch.float32, isa) is ops
    assert vector_calls == [1, most, 6]
    assert torch.equal(layer(x[:3]), exact(x[:3], weight, bias))
    assert vector_calls == [1, most, 6, 3]


def test_copies_only_layers_it_takes_within_the_memory_limit(
    kernels: CpuKernels, ops: Any, isa: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    first, second = int_linear(160, 96, seed=5), int_linear(96, 100, seed=6)
    weights = [(m.weight.detach().clone(), m.bias.detach().clone()) for m in (first, second)]
    model = nn.Sequential(PackedLinear(first), PackedLinear(second))
    use_kernels(model, kernels)
    products.copies_may_take(monkeypatch, 160 * 96 * 4 - 1)
    assert pack_for_vectors(model, ops, isa) == 0 and model[0].vectors is None
    products.copies_may_take(monkeypatch, 160 * 96 * 4)
    assert pack_for_vectors(model, ops, isa) == 1  # 100 columns: not a multiple of 32
    assert model[0].vectors is not None and model[1].vectors is None
    x = small_ints(4, 160, seed=7)
    assert torch.equal(model(x), exact(exact(x, *weights[0]), *weights[1]))


def test_a_float32_model_gets_its_copies_and_decodes_as_with_onednn(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tiny Llama whose projections are multiples of 32 wide: once the runner's kernels are
    loaded (the widest build), each layer the kernel takes has its copy by that build; a
    decode batch of 8 rows runs them on the vectors, within float32 rounding of oneDNN's."""
    model_dir = save_tiny_model(
        tmp_path, hidden_size=128, intermediate_size=256, num_attention_heads=2,
        num_key_value_heads=1,
    )  # fmt: skip
    runner = build_runner(
        ModelConfig(model=str(model_dir), dtype="float32"), CacheConfig(num_gpu_blocks_override=16)
    )
    assert runner.kernels.loader.wait(timeout=600)
    vector_calls = products.spy_on_rows(monkeypatch, runner.kernels, "vector_linear")
    isa = BUILDS[0]
    linears = [m for m in runner.model.modules() if isinstance(m, PackedLinear)]
    assert [m.vectors is not None for m in linears] == [m.out_features % 32 == 0 for m in linears]
    assert {m.vectors_isa for m in linears if m.vectors is not None} == {isa}
    # 2 layers' 4 projections, and the LM head where the vocabulary is a multiple of 32
    assert sum(m.vectors is not None for m in linears) == 8 + (runner.arch.vocab_size % 32 == 0)
    hidden = torch.randn(8, 128, generator=torch.Generator().manual_seed(8))
    layer = runner.model.model.layers[0]
    with torch.inference_mode():
        vectors = layer.mlp(hidden)
        assert vector_calls == [8, 8]  # gate_up, down
        runner.kernels.set_enabled(True, products=False)
        try:
            onednn = layer.mlp(hidden)
        finally:
            runner.kernels.set_enabled(True)
    assert vector_calls == [8, 8]
    torch.testing.assert_close(vectors, onednn, rtol=1e-5, atol=1e-5)
