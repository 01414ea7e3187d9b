"""Products over GGUF's quantized blocks (csrc/cpu/linear_gguf.cpp) and `--quantization gguf`:
the kernel's result is x rounded to 8 bits per block times the dequantized weight, exact where
the float32 sums are; `PackedLinear` takes it for up to `GGUF_MAX_ROWS` rows; an engine on the
default model serves every layer from the file's blocks, with dense's greedy tokens."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from blockserve.errors import InvalidConfigError
from blockserve.kernels import CpuKernels
from blockserve.kernels import build as cpu_build
from blockserve.model.gguf_weights import BLOCKS
from blockserve.model.packed import GGUF_MAX_ROWS, PackedLinear
from blockserve.model.weight_copies import pack_for_gguf, use_kernels
from tests.kernels.products import exact

BF16 = cpu_build.can_build(torch.bfloat16)
needs_bf16 = pytest.mark.skipif(
    not BF16, reason="needs an x86 CPU with AVX512-BF16 and VNNI, and g++ (the kernel's ISA)"
)
TYPES = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 8}


def blocks(qtype: int, n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random [n, k] weights as GGUF blocks of `qtype` (uint8 [n, k / 32 · bytes]) and as the
    gguf package dequantizes them (float64): scales 1/4, 1/2 or 1 and Q4_1 offsets in quarters,
    so that every sum the kernel makes of them is exact in float32."""
    rng = np.random.default_rng(seed)
    count = n * k // 32
    scale = rng.choice([0.25, 0.5, 1.0], count).astype(np.float16)
    parts = [scale.view(np.uint8).reshape(count, 2)]
    if qtype == 3:
        offset = (rng.integers(-8, 9, count) / 4).astype(np.float16)
        parts.append(offset.view(np.uint8).reshape(count, 2))
    if qtype == 8:
        parts.append(rng.integers(-127, 128, (count, 32)).astype(np.int8).view(np.uint8))
    else:
        parts.append(rng.integers(0, 256, (count, 16)).astype(np.uint8))
    raw = np.concatenate(parts, axis=1).reshape(n, k // 32 * BLOCKS[qtype][1])
    weight = dequantize(raw, GGMLQuantizationType(qtype)).astype(np.float64)
    return torch.from_numpy(np.ascontiguousarray(raw)), torch.from_numpy(weight)


def exact_rows(rows: int, k: int, seed: int) -> torch.Tensor:
    """bf16 integers in [-127, 127], each block of 32 holding ±127: rounding to 8 bits per
    block leaves them as they are (scale 1)."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randint(-127, 128, (rows, k), generator=generator)
    x.view(rows, k // 32, 32)[:, :, 0] = 127 * (1 - 2 * (torch.arange(k // 32) % 2))
    return x.to(torch.bfloat16)


def rounded(x: torch.Tensor) -> torch.Tensor:
    """x rounded as the kernel rounds it: per block of 32, d = max|x| / 127, q = x / d to the
    nearest integer (ties to even), float64 d · q."""
    v = x.float().numpy().reshape(x.shape[0], -1, 32)
    d = (np.abs(v).max(-1, keepdims=True) / np.float32(127)).astype(np.float32)
    inverse = np.divide(np.float32(1), d, out=np.zeros_like(d), where=d != 0)
    q = np.rint(v * inverse)
    return torch.from_numpy((q * d).astype(np.float64).reshape(x.shape))


@pytest.fixture(scope="module")
def ops(kernels: CpuKernels) -> Any:
    loaded = kernels.loader.ops(torch.bfloat16)
    assert loaded is not None
    return loaded


@needs_bf16
@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("rows", [1, 3, 5, 8, 9, 13])
@pytest.mark.parametrize("bias", [False, True])
def test_the_product_is_the_exact_one_rounded_once(
    ops: Any, name: str, rows: int, bias: bool
) -> None:
    """Rows in passes of 8 (and a remainder), 18 blocks along k, 6 groups of 16 columns."""
    qtype = TYPES[name]
    raw, weight = blocks(qtype, 96, 576, seed=qtype)
    x = exact_rows(rows, 576, seed=rows)
    bias_value = torch.arange(96).to(torch.bfloat16) / 4 if bias else None
    got = ops.gguf_linear(x, ops.gguf_pack(raw, qtype), qtype, bias_value)
    assert got.shape == (rows, 96) and got.dtype == torch.bfloat16
    assert torch.equal(got, exact(x.double(), weight, bias_value).to(torch.bfloat16))


@needs_bf16
@pytest.mark.parametrize("name", TYPES)
def test_x_is_rounded_to_8_bits_per_block_of_32(ops: Any, name: str) -> None:
    """Any x: its rounded values times the weight, within a bf16 step (the float32 sums'
    order); a zero block of x gives zeros."""
    qtype = TYPES[name]
    raw, weight = blocks(qtype, 64, 256, seed=5)
    x = torch.randn(6, 256, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    x[2] = 0  # a zero block: scale 0, no division by it
    got = ops.gguf_linear(x, ops.gguf_pack(raw, qtype), qtype, None).double()
    want = rounded(x) @ weight.T
    assert (got - want).abs().max() <= want.abs().max() * 2**-7
    assert torch.equal(got[2], torch.zeros(64, dtype=torch.float64))


@needs_bf16
def test_packing_keeps_the_files_bits_in_records_of_16_columns(ops: Any) -> None:
    """Q4_1, one block: d (16 × f16), m (16 × f16), then four 64-byte loads whose lane c holds
    k 8i..8i+3 of column c in its low nibbles and k 8i+4..8i+7 in its high ones."""
    raw, _ = blocks(3, 16, 32, seed=7)
    packed = ops.gguf_pack(raw, 3)
    assert packed.shape == (1, 320)
    assert torch.equal(packed[0, :32].view(16, 2), raw[:, :2])
    assert torch.equal(packed[0, 32:64].view(16, 2), raw[:, 2:4])
    nibbles = torch.cat([raw[:, 4:] & 0x0F, raw[:, 4:] >> 4], dim=1)  # [column, k]
    loads = packed[0, 64:].view(4, 16, 4)  # [load, column, byte]
    for i in range(4):
        assert torch.equal(loads[i] & 0x0F, nibbles[:, 8 * i : 8 * i + 4])
        assert torch.equal(loads[i] >> 4, nibbles[:, 8 * i + 4 : 8 * i + 8])


@needs_bf16
@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda ops, raw: ops.gguf_pack(raw, 12), "GGML type 12 is not one of"),
        (lambda ops, raw: ops.gguf_pack(raw[:8], 3), "not a multiple of 16"),
        (
            lambda ops, raw: ops.gguf_linear(
                torch.zeros(1, 64, dtype=torch.bfloat16), ops.gguf_pack(raw, 3), 3, None
            ),
            "x has 64 columns",
        ),
        (
            lambda ops, raw: ops.gguf_linear(torch.zeros(1, 32), ops.gguf_pack(raw, 3), 3, None),
            "x must be [rows, k] bfloat16",
        ),
    ],
)
def test_what_the_kernel_refuses(ops: Any, call: Any, message: str) -> None:
    raw, _ = blocks(3, 16, 32, seed=8)
    with pytest.raises(RuntimeError, match=message.replace("[", r"\[").replace("]", r"\]")):
        call(ops, raw)


@needs_bf16
def test_packed_linear_takes_the_blocks_for_few_rows(kernels: CpuKernels, ops: Any) -> None:
    raw, weight = blocks(3, 64, 128, seed=9)
    linear = torch.nn.Linear(128, 64, bias=False)
    with torch.no_grad():
        linear.weight.copy_(weight.float())
    layer = PackedLinear(linear.to(torch.bfloat16))
    layer.gguf, layer.gguf_type = raw, 3
    use_kernels(layer, kernels)
    assert pack_for_gguf(layer, ops) == 1 and layer.gguf_packed
    few, many = exact_rows(GGUF_MAX_ROWS, 128, seed=1), exact_rows(GGUF_MAX_ROWS + 1, 128, seed=2)
    assert torch.equal(layer(few), ops.gguf_linear(few, layer.gguf, 3, None))
    # More rows: the bf16 weight's products (the blocks' values are exact in bf16 here).
    assert torch.equal(layer(many), exact(many.double(), weight, None).to(torch.bfloat16))


def test_quantization_gguf_needs_a_gguf_model(tiny_llama_dir: Path) -> None:
    """Refused before the engine allocates anything: another model, or a dtype the kernel does
    not run in."""
    from blockserve.config import CacheConfig, ModelConfig
    from blockserve.model.loader import check_gguf_quantization
    from blockserve.runner.build import build_runner

    with pytest.raises(InvalidConfigError, match=r"serves a \.gguf model, not /x/model"):
        check_gguf_quantization("/x/model", torch.bfloat16, "cpu")
    with pytest.raises(InvalidConfigError, match="runs on a CPU with AVX512-BF16, in bfloat16"):
        check_gguf_quantization(None, torch.float32, "cpu")
    config = ModelConfig(model=str(tiny_llama_dir), quantization="gguf", device="cpu")
    with pytest.raises(InvalidConfigError, match=f"not {tiny_llama_dir}"):
        build_runner(config, CacheConfig(num_gpu_blocks_override=8))


def test_quantization_gguf_serves_llama_files_alone(tmp_path: Path) -> None:
    """Another architecture orders its q/k rows otherwise: refused, not served wrong."""
    from blockserve.model.gguf_weights import quantized_linears
    from tests.model.test_gguf_llama import write_gguf

    write_gguf(tmp_path / "qwen.gguf", "qwen2", "blk.0.attn_q.weight")
    with pytest.raises(InvalidConfigError, match=r"serves Llama GGUF files; qwen\.gguf is 'qwen2'"):
        quantized_linears(tmp_path / "qwen.gguf", None)  # type: ignore[arg-type]


@needs_bf16
def test_the_default_model_serves_its_blocks_with_denses_greedy_tokens() -> None:
    """Every linear layer of SmolLM2-135M (Q4_1, and the Q8_0 embedding as the LM head) takes
    the file's blocks; greedy tokens are the dequantized model's where the model is sure of
    them (x's rounding moves logits by a little: where two tokens are close, either may win)."""
    from blockserve import LLM, SamplingParams

    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2)
    prompts = ["1, 2, 3, 4, 5, 6,", "Monday, Tuesday, Wednesday,", "The capital of France is"]
    dense = [o.outputs[0] for o in LLM().generate(prompts, params, use_tqdm=False)]
    llm = LLM(quantization="gguf")
    kernels = llm.engine.core.runner.kernels
    assert kernels.loader.wait()
    linears = [m for m in llm.engine.core.runner.model.modules() if isinstance(m, PackedLinear)]
    assert len(linears) == 30 * 4 + 1 and all(m.gguf_packed for m in linears)
    assert {m.gguf_type for m in linears} == {3, 8}
    served = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    compared = 0
    for want, got in zip(dense, served, strict=True):
        # Up to the first token dense chose by less than 0.5 in log-probability.
        margins = [lp.logprob - sorted(lp.top.values())[-2] for lp in want.logprobs]
        sure = next((i for i, margin in enumerate(margins) if margin < 0.5), len(margins))
        assert got[:sure] == want.token_ids[:sure]
        compared += sure
    assert compared >= 12
