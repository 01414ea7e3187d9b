"""Our products on AMX tiles (csrc/cpu/linear_bf16.cpp), the gate/up product fused with
SiLU · up, and the `PackedLinear` path to them: exact where the float32 sums are, refusing
what they do not handle, taken for any rows of a layer that has its tile copy (oneDNN's
products otherwise), and the copies made for a bf16 model once our kernels are loaded."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from blockserve.config import CacheConfig, ModelConfig
from blockserve.kernels import CpuKernels
from blockserve.model.packed import PackedLinear
from blockserve.model.weight_copies import pack_for_tiles, use_kernels
from blockserve.runner.build import build_runner
from tests.kernels import products
from tests.kernels.products import exact
from tests.kernels.test_cpu_kernel import AMX
from tests.tiny_models import save_tiny_model

pytestmark = pytest.mark.skipif(
    not AMX, reason="needs an x86 CPU with AMX-BF16 (elsewhere oneDNN or our vectors serve)"
)


@pytest.fixture(scope="module")
def ops(kernels: CpuKernels) -> Iterator[Any]:
    loaded = kernels.loader.ops(torch.bfloat16)
    assert loaded is not None and loaded.has_amx()
    assert kernels.use_amx(True)
    yield loaded
    kernels.use_amx(True)  # the default, whatever a test left


def small_ints(*shape: int, seed: int) -> torch.Tensor:
    return products.small_ints(*shape, seed=seed, dtype=torch.bfloat16)


@pytest.mark.parametrize("rows", [0, 1, 5, 16, 17, 32, 33, 48, 49, 64, 100])
@pytest.mark.parametrize("bias", [False, True])
def test_the_product_is_the_exact_one_rounded_once(ops: Any, rows: int, bias: bool) -> None:
    """No rows, one row tile (up to 16 rows), or passes of 32 rows with a last pass of one
    row tile where 16 or fewer are left (33, 48, 100), padding rows never written; 5 steps of
    32 along k, 3 blocks of 32 columns shared by 2 threads."""
    weight = small_ints(96, 160, seed=1)
    bias_value = small_ints(96, seed=2) if bias else None
    x = small_ints(rows, 2 * 160, seed=rows)[:, 160:]  # rows of a wider tensor: a view
    got = ops.tile_linear(x, ops.tile_pack(weight), bias_value)
    assert got.shape == (rows, 96) and got.dtype == torch.bfloat16
    assert torch.equal(got, exact(x, weight, bias_value))


@pytest.mark.parametrize("rows", [585, 640])
def test_rows_past_the_chunk_size_are_cut_into_chunks_each_thread_its_own(
    ops: Any, rows: int
) -> None:
    """x of 1,024 columns: 256 rows fill a chunk (512 KB). On 2 threads, 585 rows are 3
    chunks' worth, rounded up to 4, of 160 rows, the last 112 (its last pass one row tile);
    640 rows: 4 chunks of 160."""
    weight = small_ints(64, 1024, seed=11)
    x = small_ints(rows, 1024, seed=12)
    got = ops.tile_linear(x, ops.tile_pack(weight), None)
    assert torch.equal(got, exact(x, weight, None))


@pytest.mark.parametrize("rows", [0, 1, 17, 33, 585])
def test_the_fused_gate_up_product_is_silu_and_mul_of_the_product(ops: Any, rows: int) -> None:
    """SiLU of the first half of the product's columns times the second half, each rounded
    as `silu_and_mul` rounds the product it reads: the same bits. 32 output columns: gate
    blocks 0-1 paired with up blocks 2-3."""
    weight = small_ints(64, 1024, seed=13)
    x = small_ints(rows, 1024, seed=14)
    tiles = ops.tile_pack(weight)
    got = ops.tile_linear_silu(x, tiles)
    assert got.shape == (rows, 32) and got.dtype == torch.bfloat16
    assert torch.equal(got, ops.silu_and_mul(exact(x, weight, None)))


def test_packing_puts_each_32_k_by_16_columns_in_one_kilobyte(ops: Any) -> None:
    """The layout the kernel reads: block b, step s at (b * K/32 + s) * 512, row p holding
    the pairs (W[n][32s + 2p], W[n][32s + 2p + 1]) of the block's 16 columns n."""
    weight = torch.arange(64 * 64).view(64, 64).to(torch.float32)  # exact in bf16 up to 256
    weight = (weight % 251).to(torch.bfloat16)
    tiles = ops.tile_pack(weight).view(4, 2, 16, 16, 2)  # [blocks, steps, pairs, columns, 2]
    for block, step, pair, column in ((0, 0, 0, 0), (1, 1, 15, 3), (3, 0, 7, 15), (2, 1, 4, 9)):
        n, k = block * 16 + column, step * 32 + 2 * pair
        assert torch.equal(tiles[block, step, pair, column], weight[n, k : k + 2])


def bf16(*shape: int) -> torch.Tensor:
    return torch.zeros(*shape, dtype=torch.bfloat16)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda o: o.tile_pack(torch.zeros(64, 64)), "bfloat16"),
        (lambda o: o.tile_pack(bf16(48, 64)), "multiple of"),
        (lambda o: o.tile_pack(bf16(64, 40)), "multiple of"),
        (lambda o: o.tile_linear(bf16(2, 32), o.tile_pack(bf16(64, 64)), None), "columns"),
        (lambda o: o.tile_linear(torch.zeros(2, 64), o.tile_pack(bf16(64, 64)), None), "bfloat16"),
        (lambda o: o.tile_linear(bf16(2, 64), o.tile_pack(bf16(64, 64)), bf16(32)), "bias"),
        (lambda o: o.tile_linear(bf16(2, 64), bf16(64, 128)[:, :64], None), "columns"),
        (lambda o: o.tile_linear_silu(bf16(2, 32), o.tile_pack(bf16(64, 64))), "columns"),
        (lambda o: o.tile_linear_silu(bf16(2, 64), o.tile_pack(bf16(48, 64))), "multiple of"),
    ],
)
def test_refuses_what_it_does_not_handle(ops: Any, call: Callable[[Any], Any], message: str):
    with pytest.raises(RuntimeError, match=message):
        call(ops)


def int_linear(in_features: int, out_features: int, seed: int) -> nn.Linear:
    return products.int_linear(in_features, out_features, seed, torch.bfloat16)


@pytest.fixture
def tile_calls(monkeypatch: pytest.MonkeyPatch, kernels: CpuKernels) -> list[int]:
    """The rows of each product the tile kernel was handed."""
    return products.spy_on_rows(monkeypatch, kernels, "tile_linear")


def test_a_packed_linear_takes_the_tiles_once_it_has_its_copy(
    kernels: CpuKernels, ops: Any, tile_calls: list[int]
) -> None:
    linear = int_linear(160, 96, seed=3)
    weight, bias = linear.weight.detach().clone(), linear.bias.detach().clone()
    layer = PackedLinear(linear)
    use_kernels(layer, kernels)
    assert layer.tiles is None
    x = small_ints(600, 160, seed=4)
    assert torch.equal(layer(x[:3]), exact(x[:3], weight, bias)) and tile_calls == []

    assert pack_for_tiles(layer, ops) == 1 and layer.tiles is not None
    for rows in (1, 128, 600):  # a decode step's rows to a prefill's
        assert torch.equal(layer(x[:rows]), exact(x[:rows], weight, bias))
    assert torch.equal(layer(x[:6].view(2, 3, 160)), exact(x[:6], weight, bias).view(2, 3, 96))
    assert tile_calls == [1, 128, 600, 6]

    assert not kernels.use_amx(False)
    assert torch.equal(layer(x[:3]), exact(x[:3], weight, bias))
    assert kernels.use_amx(True)
    kernels.set_enabled(True, products=False)  # oneDNN's products, the other kernels ours
    try:
        assert torch.equal(layer(x[:3]), exact(x[:3], weight, bias))
    finally:
        kernels.set_enabled(True)
    assert tile_calls == [1, 128, 600, 6]
    assert torch.equal(layer(x[:3]), exact(x[:3], weight, bias))
    assert tile_calls == [1, 128, 600, 6, 3]


def test_a_gate_up_projection_fuses_its_silu_where_its_product_takes_the_tiles(
    kernels: CpuKernels, ops: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`PackedLinear.silu_and_mul` is `silu_and_mul` of its product either way: one fused call
    where the product would run on the tiles; the product, then `silu_and_mul`, where not
    (no tile copy yet, the tiles switched off)."""
    fused = products.spy_on_rows(monkeypatch, kernels, "tile_linear_silu")
    linear = int_linear(160, 96, seed=15)
    weight = linear.weight.detach().clone()
    linear.bias = None
    layer = PackedLinear(linear)
    use_kernels(layer, kernels)
    x = small_ints(600, 160, seed=16)
    expected = ops.silu_and_mul(exact(x, weight, None))
    assert torch.equal(layer.silu_and_mul(x[:5], ops), expected[:5]) and fused == []
    pack_for_tiles(layer, ops)
    assert torch.equal(layer.silu_and_mul(x[:5], ops), expected[:5])
    assert torch.equal(layer.silu_and_mul(x, ops), expected)
    assert torch.equal(layer.silu_and_mul(x[:4].view(2, 2, 160), ops), expected[:4].view(2, 2, 48))
    assert fused == [5, 600, 4]
    kernels.use_amx(False)
    try:
        assert torch.equal(layer.silu_and_mul(x[:5], ops), expected[:5])
    finally:
        kernels.use_amx(True)
    assert fused == [5, 600, 4]


def test_copies_only_layers_it_takes_within_the_memory_limit(
    kernels: CpuKernels, ops: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    first, second = int_linear(160, 96, seed=5), int_linear(96, 100, seed=6)
    weights = [(m.weight.detach().clone(), m.bias.detach().clone()) for m in (first, second)]
    model = nn.Sequential(PackedLinear(first), PackedLinear(second))
    use_kernels(model, kernels)
    products.copies_may_take(monkeypatch, 160 * 96 * 2 - 1)
    assert pack_for_tiles(model, ops) == 0 and model[0].tiles is None
    products.copies_may_take(monkeypatch, 160 * 96 * 2)
    assert pack_for_tiles(model, ops) == 1  # 100 columns: not a multiple of 32
    assert model[0].tiles is not None and model[1].tiles is None
    x = small_ints(4, 160, seed=7)
    assert torch.equal(model(x), exact(exact(x, *weights[0]), *weights[1]))


def test_a_bf16_model_gets_its_copies_and_decodes_as_with_onednn(
    ops: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tiny Llama whose projections are multiples of 32 wide: once the runner's kernels are
    loaded, each layer the kernel takes has its copy; a decode batch of 8 rows runs them on
    the tiles (the MLP's SiLU fused with its gate/up product), within bf16 rounding of
    oneDNN's."""
    model_dir = save_tiny_model(
        tmp_path, hidden_size=128, intermediate_size=256, num_attention_heads=2,
        num_key_value_heads=1,
    )  # fmt: skip
    runner = build_runner(
        ModelConfig(model=str(model_dir), dtype="bfloat16"), CacheConfig(num_gpu_blocks_override=16)
    )
    assert runner.kernels.loader.wait(timeout=600)
    tile_calls = products.spy_on_rows(monkeypatch, runner.kernels, "tile_linear")
    fused_calls = products.spy_on_rows(monkeypatch, runner.kernels, "tile_linear_silu")
    linears = [m for m in runner.model.modules() if isinstance(m, PackedLinear)]
    assert [m.tiles is not None for m in linears] == [m.out_features % 32 == 0 for m in linears]
    # 2 layers' 4 projections, and the LM head where the vocabulary is a multiple of 32
    assert sum(m.tiles is not None for m in linears) == 8 + (runner.arch.vocab_size % 32 == 0)
    hidden = torch.randn(8, 128, generator=torch.Generator().manual_seed(8)).bfloat16()
    layer = runner.model.model.layers[0]
    layer_ops = runner.kernels.layer_ops(hidden, head_dim=64)
    with torch.inference_mode():
        tiles = layer.mlp(hidden, layer_ops)
        assert (fused_calls, tile_calls) == ([8], [8])  # gate_up with SiLU · up, down
        runner.kernels.use_amx(False)
        try:
            onednn = layer.mlp(hidden, layer_ops)
        finally:
            runner.kernels.use_amx(True)
    assert (fused_calls, tile_calls) == ([8], [8])
    assert (tiles.float() - onednn.float()).abs().max() <= 2**-7 * onednn.float().abs().max()
