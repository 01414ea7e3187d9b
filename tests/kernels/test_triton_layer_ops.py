"""Triton's fused layer operators (kernels/triton_layer_ops.py), under the interpreter on a CPU
and compiled on a CUDA device: each equals torch's composition within its dtype's rounding,
and the model's fused forward through them gives the unfused forward's logits."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from blockserve.config import CacheConfig, ModelConfig
from blockserve.kernels.triton_layer_ops import TritonLayerOps
from blockserve.model.llama import RMSNorm
from blockserve.model.rope import apply_rotary
from blockserve.runner.build import build_runner
from tests.runner.test_model_runner import all_logits, mixed_batch
from tests.tiny_models import save_tiny_model

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# float16 and float32 (the interpreter computes bfloat16 wrongly); bound in units of the largest
# value: one step of the dtype, twice.
DTYPES = {torch.float32: 1e-6, torch.float16: 2 * 2**-10}
if DEVICE == "cuda":
    DTYPES[torch.bfloat16] = 2 * 2**-7
OPS = TritonLayerOps()


def randn(*shape: int, seed: int, dtype: torch.dtype) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=generator).to(device=DEVICE, dtype=dtype)


def close(got: torch.Tensor, want: torch.Tensor, bound: float) -> bool:
    return (got.float() - want.float()).abs().max().item() <= bound * want.float().abs().max()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 96])  # 96: a block past the row, masked
def test_rms_norm_and_the_residual_add(dtype: torch.dtype, hidden: int) -> None:
    x, update = randn(5, hidden, seed=1, dtype=dtype), randn(5, hidden, seed=2, dtype=dtype)
    norm = RMSNorm(hidden, 1e-5).to(device=DEVICE, dtype=dtype)
    with torch.no_grad():
        norm.weight.copy_(randn(hidden, seed=3, dtype=dtype))
        assert close(OPS.rms_norm(x, norm.weight, norm.eps), norm(x), DTYPES[dtype])
        residual = x.clone()
        out = OPS.add_rms_norm(residual, update, norm.weight, norm.eps)
        assert torch.equal(residual, x + update)  # updated in place, rounded as torch rounds
        assert close(out, norm(x + update), DTYPES[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_rotates_q_and_k_in_place_and_leaves_v(dtype: torch.dtype) -> None:
    tokens, q_heads, kv_heads, dim = 3, 4, 2, 64
    qkv = randn(tokens, (q_heads + 2 * kv_heads) * dim, seed=4, dtype=dtype)
    angles = randn(tokens, 1, dim // 2, seed=5, dtype=torch.float32)
    rope = (angles.cos().to(dtype), angles.sin().to(dtype))
    heads = qkv.view(tokens, -1, dim)
    want_qk = apply_rotary(heads[:, : q_heads + kv_heads], rope)
    v = heads[:, q_heads + kv_heads :].clone()
    OPS.rotary_(qkv, rope[0].view(tokens, -1), rope[1].view(tokens, -1), q_heads, kv_heads)
    assert close(heads[:, : q_heads + kv_heads], want_qk, DTYPES[dtype])
    assert torch.equal(heads[:, q_heads + kv_heads :], v)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(dtype: torch.dtype) -> None:
    gate_up = randn(4, 2 * 160, seed=6, dtype=dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    assert close(OPS.silu_and_mul(gate_up), F.silu(gate) * up, DTYPES[dtype])


class EveryDevice:
    """Hands the Triton operators out on any device (the engine does so on CUDA only)."""

    def __init__(self) -> None:
        self.forwards = 0

    def layer_ops(self, hidden: torch.Tensor, head_dim: int) -> Any:
        self.forwards += 1
        return OPS


@pytest.mark.slow
def test_the_fused_forward_through_them_equals_the_unfused_one(tmp_path: Path) -> None:
    """A fresh prefill, a prefill on cached blocks and a decode in one step, float32."""
    model_dir = save_tiny_model(tmp_path, hidden_size=128, intermediate_size=256,
                                num_attention_heads=2, num_key_value_heads=1)  # fmt: skip
    runner = build_runner(
        ModelConfig(model=str(model_dir), dtype="float32", device=DEVICE),
        CacheConfig(num_gpu_blocks_override=64),
    )
    triton_ops = runner.model.kernels = EveryDevice()
    batch = mixed_batch(Path(runner.loaded.model_dir))
    all_logits(runner, batch.first)
    fused = all_logits(runner, batch.second)
    assert triton_ops.forwards == 2
    runner.kernels.set_enabled(False)  # our CPU library out too: torch's operators alone
    runner.model.kernels = runner.kernels
    all_logits(runner, batch.first)
    unfused = all_logits(runner, batch.second)
    assert fused.shape == unfused.shape == (29, 320)
    assert (fused - unfused).abs().max().item() <= 1e-5 * unfused.abs().max().item()
