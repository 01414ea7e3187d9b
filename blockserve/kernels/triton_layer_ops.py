"""A layer's elementwise math as Triton kernels for CUDA devices, one launch each: RMSNorm (with
the residual add), rotary embedding in place, SiLU-and-multiply. The same interface as our CPU
library's layer operators, so the model's fused forward serves either; sums in float32."""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    x_ptr,  # [rows, n]: the input, or with ADD the residual (updated in place)
    update_ptr,  # [rows, n]: added to the residual first (ADD only)
    weight_ptr,  # [n]
    out_ptr,  # [rows, n]
    stride_x,
    stride_update,
    stride_out,
    n,
    eps,
    ADD: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if ADD:
        update = tl.load(update_ptr + row * stride_update + cols, mask=mask, other=0.0)
        x = x + update  # in the residual's dtype, as `residual + update` rounds
        tl.store(x_ptr + row * stride_x + cols, x, mask=mask)
    x = x.to(tl.float32)
    variance = tl.sum(x * x, axis=0) / n
    normed = (x * tl.rsqrt(variance + eps)).to(out_ptr.dtype.element_ty)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    tl.store(out_ptr + row * stride_out + cols, normed * weight, mask=mask)


@triton.jit
def _rotary_kernel(
    qkv_ptr,  # [tokens, heads * 2 * HALF]: each q and k head rotated in place
    cos_ptr,  # [tokens, HALF]
    sin_ptr,
    stride_qkv,
    stride_rope,
    HALF: tl.constexpr,
    BLOCK: tl.constexpr,
):
    token = tl.program_id(0)
    head = tl.program_id(1)
    cols = tl.arange(0, BLOCK)
    mask = cols < HALF
    base = qkv_ptr + token * stride_qkv + head * 2 * HALF
    x1 = tl.load(base + cols, mask=mask, other=0.0)
    x2 = tl.load(base + HALF + cols, mask=mask, other=0.0)
    cos = tl.load(cos_ptr + token * stride_rope + cols, mask=mask, other=0.0)
    sin = tl.load(sin_ptr + token * stride_rope + cols, mask=mask, other=0.0)
    tl.store(base + cols, x1 * cos - x2 * sin, mask=mask)
    tl.store(base + HALF + cols, x2 * cos + x1 * sin, mask=mask)


@triton.jit
def _silu_and_mul_kernel(
    gate_up_ptr,  # [rows, 2n]: gate, then up
    out_ptr,  # [rows, n]
    stride_in,
    stride_out,
    n,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    gate = tl.load(gate_up_ptr + row * stride_in + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * stride_in + n + cols, mask=mask, other=0.0)
    silu = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_out + cols, silu * up, mask=mask)


class TritonLayerOps:
    """rms_norm, add_rms_norm, rotary_, silu_and_mul over row-major tensors (unit stride along
    the last dimension), as the CPU library's operators of the same names."""

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        out = torch.empty_like(x)
        self._norm(x, x, weight, out, eps, add=False)
        return out

    def add_rms_norm(
        self, residual: torch.Tensor, update: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        """`residual += update` in place, then the RMSNorm of the new residual."""
        out = torch.empty_like(residual)
        self._norm(residual, update, weight, out, eps, add=True)
        return out

    def _norm(
        self,
        x: torch.Tensor,
        update: torch.Tensor,
        weight: torch.Tensor,
        out: torch.Tensor,
        eps: float,
        add: bool,
    ) -> None:
        rows, n = x.shape
        _rms_norm_kernel[(rows,)](
            x,
            update,
            weight,
            out,
            x.stride(0),
            update.stride(0),
            out.stride(0),
            n,
            eps,
            ADD=add,
            BLOCK=triton.next_power_of_2(n),
        )

    def rotary_(
        self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q_heads: int, kv_heads: int
    ) -> None:
        """Each q and k head's halves (x1, x2) → (x1 cos − x2 sin, x2 cos + x1 sin), in place;
        cos, sin: [tokens, head_dim / 2] in qkv's dtype."""
        tokens, half = cos.shape
        _rotary_kernel[(tokens, q_heads + kv_heads)](
            qkv,
            cos,
            sin,
            qkv.stride(0),
            cos.stride(0),
            HALF=half,
            BLOCK=triton.next_power_of_2(half),
        )

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        rows, n = gate_up.shape[0], gate_up.shape[1] // 2
        out = gate_up.new_empty(rows, n)
        block = min(1024, triton.next_power_of_2(n))
        grid = (rows, triton.cdiv(n, block))
        _silu_and_mul_kernel[grid](gate_up, out, gate_up.stride(0), out.stride(0), n, BLOCK=block)
        return out


class GpuKernels:
    """The fused layer operators for a model on a CUDA device (the model asks `layer_ops` each
    forward, as it asks `CpuKernels` on a CPU)."""

    def __init__(self) -> None:
        self._ops = TritonLayerOps()

    def layer_ops(self, hidden: torch.Tensor, head_dim: int) -> Any:
        """The operators for hidden states like `hidden` on a CUDA device, else None."""
        if hidden.device.type != "cuda" or hidden.stride(-1) != 1:
            return None
        return self._ops
