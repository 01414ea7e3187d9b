"""Our fused layer operators (csrc/cpu/layer_ops_bf16.cpp, layer_ops_f32.cpp): RMSNorm with
and without the residual add, the rotary embedding in place, SiLU-and-multiply, the argmax of
greedy sampling and the K/V cache write. Each equals torch's composition in model/llama.py in
its dtype bit for bit, or within a few steps of it where noted; each refuses what it does not
handle; and the eager forward that uses them gives the forward without them."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from blockserve.config import CacheConfig, ModelConfig
from blockserve.kernels import CpuKernels
from blockserve.model.llama import RMSNorm
from blockserve.model.rope import RotaryEmbedding, apply_rotary
from blockserve.runner.build import build_runner
from blockserve.runner.model_runner import ModelRunner
from tests.kernels.test_cpu_kernel import DTYPES, NEEDS
from tests.runner.test_model_runner import all_logits, greedy_generate, mixed_batch
from tests.tiny_models import save_tiny_model


def layer_ops(kernels: CpuKernels, dtype: torch.dtype) -> Any:
    op = kernels.layer_ops(torch.zeros(1, 576, dtype=dtype), head_dim=64)
    assert op is not None
    return op


@pytest.fixture(scope="module")
def ops(kernels: CpuKernels) -> Any:
    """The bf16 library's operators."""
    return layer_ops(kernels, torch.bfloat16)


@pytest.fixture(scope="module")
def ops32(kernels: CpuKernels) -> Any:
    """The float32 library's operators."""
    return layer_ops(kernels, torch.float32)


def bf16_steps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many bf16 steps apart each pair of elements is (same-signed values)."""
    return (a.view(torch.int16).int() - b.view(torch.int16).int()).abs()


def randn(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).bfloat16()


def norm_with(weight: torch.Tensor) -> RMSNorm:
    norm = RMSNorm(weight.shape[0], 1e-5).bfloat16()
    norm.weight.data.copy_(weight)
    return norm


@NEEDS[torch.bfloat16]
@pytest.mark.parametrize("rows", [1, 64, 2048])
def test_rms_norm_equals_torch_within_two_steps(ops: Any, rows: int) -> None:
    """Its mean of squares is summed in another order: now and then the normalized value is
    one bf16 step apart, which the weight's product carries to at most two."""
    x = randn(rows, 2 * 576, seed=rows)[:, 576:]  # rows of a wider tensor: a view
    weight = randn(576, seed=1) + 1
    expected = norm_with(weight)(x)
    steps = bf16_steps(ops.rms_norm(x, weight, 1e-5), expected)
    assert steps.max().item() <= 2
    assert steps.sum().item() <= rows * 576 // 500


@NEEDS[torch.bfloat16]
def test_add_rms_norm_adds_in_place_then_normalizes(ops: Any) -> None:
    """The residual to the bit; the norm as `rms_norm`'s."""
    residual, update = randn(300, 576, seed=2), randn(300, 576, seed=3)
    weight = randn(576, seed=4) + 1
    expected_residual = residual + update
    out = ops.add_rms_norm(residual, update, weight, 1e-5)
    assert torch.equal(residual, expected_residual)
    steps = bf16_steps(out, norm_with(weight)(expected_residual))
    assert steps.max().item() <= 2
    assert steps.sum().item() <= 300 * 576 // 500


@NEEDS[torch.bfloat16]
@pytest.mark.parametrize("tokens", [1, 37, 2048])
def test_rotary_rotates_q_and_k_in_place_as_torch_does(ops: Any, tokens: int) -> None:
    """SmolLM2's heads (9 q, 3 KV) at positions up to 8k: q and k to the bit, v untouched."""
    qkv = randn(tokens, (9 + 2 * 3) * 64, seed=tokens)
    positions = torch.randint(0, 8192, (tokens,), generator=torch.Generator().manual_seed(5))
    cos, sin = RotaryEmbedding(64, 8192, 100000.0, None)(positions, torch.bfloat16)
    q, k, v = qkv.split([9 * 64, 3 * 64, 3 * 64], dim=-1)
    expected_q = apply_rotary(q.reshape(tokens, 9, 64), (cos, sin))
    expected_k = apply_rotary(k.reshape(tokens, 3, 64), (cos, sin))
    expected_v = v.clone()
    ops.rotary_(qkv, cos.view(tokens, 32), sin.view(tokens, 32), 9, 3)
    assert torch.equal(q.reshape(tokens, 9, 64), expected_q)
    assert torch.equal(k.reshape(tokens, 3, 64), expected_k)
    assert torch.equal(v, expected_v)


@NEEDS[torch.bfloat16]
def test_silu_and_mul_equals_torch_within_one_step(ops: Any) -> None:
    """Its exp is our own: now and then one bf16 step apart, over gates from -24 to 24."""
    gate_up = randn(512, 2 * 1536, seed=6, scale=6.0)
    gate, up = gate_up.chunk(2, dim=-1)
    steps = bf16_steps(ops.silu_and_mul(gate_up), F.silu(gate) * up)
    assert steps.max().item() <= 1
    assert steps.sum().item() <= 512 * 1536 // 500


def argmax_cases(dtype: torch.dtype) -> list[torch.Tensor]:
    """Rows the greedy argmax must get exactly as torch.max does: many ties (small integers),
    lengths with and without a tail past whole vectors, all -inf, NaN in the vectors and in
    the tail, +0 after -0, and rows of a wider tensor (a view)."""
    generator = torch.Generator().manual_seed(7)
    cases = []
    for n in (1, 7, 16, 33, 49152, 49157):
        x = torch.randint(-3, 3, (12, n), generator=generator).to(dtype)
        x[0] = float("-inf")
        x[1, n // 2] = float("nan")
        x[2, -1] = float("nan")
        x[3, : min(n, 3)] = float("nan")
        x[4] = -0.0
        x[4, -1] = 0.0
        cases.append(x)
    cases.append(torch.randn(64, 2 * 49152, generator=generator).to(dtype)[:, 100 : 100 + 49152])
    return cases


@NEEDS[torch.bfloat16]
def test_argmax_rows_is_torch_max_indices(ops: Any) -> None:
    for x in argmax_cases(torch.bfloat16):
        assert ops.argmax_rows(x).tolist() == x.max(dim=-1).indices.tolist()


def kv_write_case(dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """A layer's cache [2, 6 blocks, 16, 3 KV heads, 64], a step's K and V as the QKV
    product leaves them (views of its rows), 10 slots anywhere in the cache, and the cache as
    two index_copy_ leave it."""
    generator = torch.Generator().manual_seed(11)
    kv = torch.randn(2, 6, 16, 3, 64, generator=generator).to(dtype)
    qkv = torch.randn(10, (9 + 2 * 3) * 64, generator=generator).to(dtype)
    key, value = qkv[:, 576:768].view(10, 3, 64), qkv[:, 768:].view(10, 3, 64)
    slots = torch.randperm(96, generator=generator)[:10]
    expected = kv.clone()
    expected[0].view(-1, 3, 64).index_copy_(0, slots, key)
    expected[1].view(-1, 3, 64).index_copy_(0, slots, value)
    return kv, slots, key, value, expected


@NEEDS[torch.bfloat16]
def test_write_kv_is_the_two_index_copies(ops: Any) -> None:
    kv, slots, key, value, expected = kv_write_case(torch.bfloat16)
    ops.write_kv_(kv, slots, key, value)
    assert torch.equal(kv, expected)


@NEEDS[torch.float32]
def test_float32_write_kv_is_the_two_index_copies(ops32: Any) -> None:
    kv, slots, key, value, expected = kv_write_case(torch.float32)
    ops32.write_kv_(kv, slots, key, value)
    assert torch.equal(kv, expected)


@NEEDS[torch.bfloat16]
@pytest.mark.parametrize(
    ("change", "message"),
    [
        ("a slot past the cache", "slot 96 is outside the cache"),
        ("a negative slot", "slot -1 is outside the cache"),
        ("int32 slots", "slots must be int64"),
        ("keys of another width", "key and value must be"),
        ("a float32 cache", "kv_cache must be a contiguous bfloat16"),
    ],
)
def test_write_kv_refuses_and_writes_nothing(ops: Any, change: str, message: str) -> None:
    kv, slots, key, value, _ = kv_write_case(torch.bfloat16)
    before = kv.clone()
    if change == "a slot past the cache":
        slots[-1] = 96
    elif change == "a negative slot":
        slots[3] = -1
    elif change == "int32 slots":
        slots = slots.int()
    elif change == "keys of another width":
        key = key[:, :2]
    else:
        kv = kv.float()
        before = kv.clone()
    with pytest.raises(RuntimeError, match=message):
        ops.write_kv_(kv, slots, key, value)
    assert torch.equal(kv, before)


@NEEDS[torch.bfloat16]
def test_the_kv_write_is_handed_out_only_where_it_applies(kernels: CpuKernels, ops: Any) -> None:
    """CpuKernels.write_kv gives our op for the layout the backend passes, and None (two
    index_copy_ then) for another: heads not contiguous, int32 slots, layer operators off."""
    kv, slots, key, value, _ = kv_write_case(torch.bfloat16)
    assert kernels.write_kv(kv, slots, key, value) is not None
    assert kernels.write_kv(kv, slots, key.transpose(1, 2), value) is None
    assert kernels.write_kv(kv, slots.int(), key, value) is None
    kernels.set_enabled(True, layer=False)
    try:
        assert kernels.write_kv(kv, slots, key, value) is None
    finally:
        kernels.set_enabled(True)


@NEEDS[torch.bfloat16]
def test_the_argmax_kernel_is_handed_out_only_where_it_applies(
    kernels: CpuKernels, ops: Any
) -> None:
    """CpuKernels.argmax (what the sampler asks) gives the kernel for [rows, n] rows with
    unit stride, and None where torch.max must serve: another rank, no columns, a transposed
    view, the layer operators switched off."""
    x = torch.zeros(4, 32, dtype=torch.bfloat16)
    assert kernels.argmax(x) is not None
    for other in (x[0], x[:, :0], x.t()):
        assert kernels.argmax(other) is None
    kernels.set_enabled(True, layer=False)
    try:
        assert kernels.argmax(x) is None
    finally:
        kernels.set_enabled(True)


@NEEDS[torch.float32]
def test_float32_argmax_rows_is_torch_max_indices(ops32: Any) -> None:
    for x in argmax_cases(torch.float32):
        assert ops32.argmax_rows(x).tolist() == x.max(dim=-1).indices.tolist()


@NEEDS[torch.bfloat16]
@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda o: o.rms_norm(torch.zeros(2, 64), torch.ones(64).bfloat16(), 1e-5), "bfloat16"),
        (lambda o: o.rms_norm(bf16(2, 40), bf16(40), 1e-5), "multiple of 16"),
        (lambda o: o.rms_norm(bf16(2, 64), bf16(32), 1e-5), "weight must be"),
        (lambda o: o.rms_norm(bf16(2, 64).t(), bf16(2), 1e-5), "unit stride"),
        (lambda o: o.add_rms_norm(bf16(2, 64), bf16(3, 64), bf16(64), 1e-5), "residual's shape"),
        (lambda o: o.rotary_(bf16(2, 256), bf16(2, 32), bf16(2, 32), 2, 2), "qkv must be"),
        (lambda o: o.rotary_(bf16(2, 256), bf16(2, 16), bf16(2, 32), 2, 1), "cos and sin"),
        (lambda o: o.silu_and_mul(bf16(2, 48)), "multiples of 16"),
        (lambda o: o.argmax_rows(bf16(2, 0)), "n >= 1"),
        (lambda o: o.argmax_rows(bf16(8)), r"\[rows, n\]"),
        (lambda o: o.argmax_rows(bf16(4, 2).t()), "unit stride"),
        (lambda o: o.argmax_rows(torch.zeros(2, 8)), "bfloat16"),
    ],
)
def test_refuses_what_it_does_not_handle(ops: Any, call: Callable[[Any], Any], message: str):
    with pytest.raises(RuntimeError, match=message):
        call(ops)


def bf16(*shape: int) -> torch.Tensor:
    return torch.zeros(*shape, dtype=torch.bfloat16)


def f32_steps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many float32 steps apart each pair of elements is (same-signed values)."""
    return (a.view(torch.int32).long() - b.view(torch.int32).long()).abs()


@NEEDS[torch.float32]
@pytest.mark.parametrize("rows", [1, 64, 2048])
def test_float32_rms_norm_equals_torch_within_a_few_steps(ops32: Any, rows: int) -> None:
    """The mean of squares summed in another order (in vector lanes), which moves the inverse
    root, and with it every output of the row, by a few float32 steps; the residual add to the
    bit."""
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 2 * 576, generator=generator)[:, 576:] * 3  # a view's rows
    update = torch.randn(rows, 576, generator=generator)
    weight = torch.randn(576, generator=generator) + 1
    norm = RMSNorm(576, 1e-5)
    norm.weight.data.copy_(weight)
    assert f32_steps(ops32.rms_norm(x, weight, 1e-5), norm(x)).max().item() <= 8
    residual = x.clone()
    out = ops32.add_rms_norm(residual, update, weight, 1e-5)
    assert torch.equal(residual, x + update)
    assert f32_steps(out, norm(x + update)).max().item() <= 8


@NEEDS[torch.float32]
@pytest.mark.parametrize("tokens", [1, 37, 2048])
def test_float32_rotary_is_torchs_to_the_bit(ops32: Any, tokens: int) -> None:
    """Products and sums rounded one at a time, as torch's operators do (the library is built
    without contracting them into FMAs): q and k to the bit, v untouched."""
    generator = torch.Generator().manual_seed(tokens)
    qkv = torch.randn(tokens, (9 + 2 * 3) * 64, generator=generator)
    positions = torch.randint(0, 8192, (tokens,), generator=generator)
    cos, sin = RotaryEmbedding(64, 8192, 100000.0, None)(positions, torch.float32)
    q, k, v = qkv.split([9 * 64, 3 * 64, 3 * 64], dim=-1)
    expected = [apply_rotary(x.reshape(tokens, -1, 64), (cos, sin)) for x in (q, k)]
    expected_v = v.clone()
    ops32.rotary_(qkv, cos.view(tokens, 32), sin.view(tokens, 32), 9, 3)
    assert torch.equal(q.reshape(tokens, 9, 64), expected[0])
    assert torch.equal(k.reshape(tokens, 3, 64), expected[1])
    assert torch.equal(v, expected_v)


@NEEDS[torch.float32]
def test_float32_silu_and_mul_equals_torch_to_its_exp(ops32: Any) -> None:
    """Our exp and the sigmoid from it, over gates from -24 to 24: within 4e-6 of torch's,
    relatively (the exp's range reduction rounds x log2(e), which costs ~2e-6 at x = -25)."""
    gate_up = torch.randn(512, 2 * 1536, generator=torch.Generator().manual_seed(6)) * 6
    gate, up = gate_up.chunk(2, dim=-1)
    expected = F.silu(gate) * up
    error = (ops32.silu_and_mul(gate_up) - expected).abs()
    assert (error <= 4e-6 * expected.abs()).all()


@NEEDS[torch.float32]
@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda o: o.rms_norm(torch.zeros(2, 64).double(), torch.ones(64), 1e-5), "float32"),
        (lambda o: o.rms_norm(torch.zeros(2, 40), torch.ones(40), 1e-5), "multiple of 16"),
        (lambda o: o.rotary_(torch.zeros(2, 256), torch.zeros(2, 16), torch.zeros(2, 32), 2, 1),
         "cos and sin"),
        (lambda o: o.silu_and_mul(torch.zeros(2, 48)), "multiples of 16"),
        (lambda o: o.argmax_rows(torch.zeros(2, 8).bfloat16()), "float32"),
    ],
)  # fmt: skip
def test_float32_refuses_what_it_does_not_handle(
    ops32: Any, call: Callable[[Any], Any], message: str
) -> None:
    with pytest.raises(RuntimeError, match=message):
        call(ops32)


@pytest.fixture(scope="module", params=DTYPES)
def runner(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> ModelRunner:
    """A tiny Llama whose heads are 64 wide (the kernels' width), in each library's dtype,
    once its kernels are loaded."""
    dtype = request.param
    model_dir = save_tiny_model(
        tmp_path_factory.mktemp("tiny-llama-64"),
        hidden_size=128, intermediate_size=256, num_attention_heads=2, num_key_value_heads=1,
    )  # fmt: skip
    runner = build_runner(
        ModelConfig(model=str(model_dir), dtype=str(dtype).removeprefix("torch.")),
        CacheConfig(num_gpu_blocks_override=64),
    )
    assert runner.kernels.loader.wait(timeout=600)
    return runner


@pytest.mark.slow
def test_the_fused_forward_equals_the_unfused_one(
    runner: ModelRunner, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fresh prefill, a prefill on cached blocks and a decode in one step, then 16 greedy
    tokens for 3 prompts: the same logits (within the dtype's rounding) and tokens with our
    operators as without."""
    batch = mixed_batch(Path(runner.loaded.model_dir))
    served: list[bool] = []  # whether each forward had our operators

    def counted(*args: Any) -> Any:
        found = layer_ops(*args)
        served.append(found is not None)
        return found

    kernels = runner.kernels
    layer_ops = kernels.layer_ops
    monkeypatch.setattr(kernels, "layer_ops", counted)
    results = []
    generator = torch.Generator().manual_seed(8)
    prompts = [torch.randint(0, 300, (n,), generator=generator).tolist() for n in (5, 17, 40)]
    for on in (True, False):
        kernels.set_enabled(True, layer=on)
        try:
            all_logits(runner, batch.first)
            logits = all_logits(runner, batch.second)
            results.append((logits, greedy_generate(runner, prompts, 16)))
        finally:
            kernels.set_enabled(True)
    assert served == [True] * 18 + [False] * 18  # 2 + 16 forwards each way
    (fused, fused_tokens), (unfused, unfused_tokens) = results
    assert fused.shape == unfused.shape == (29, 320)
    bound = {torch.bfloat16: 2**-7, torch.float32: 1e-5}[runner.kv_caches[0].dtype]
    assert (fused - unfused).abs().max().item() <= bound * unfused.abs().max().item()
    assert fused_tokens == unfused_tokens
    assert [len(tokens) for tokens in fused_tokens] == [16, 16, 16]
