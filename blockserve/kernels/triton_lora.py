"""LoRA's grouped products on CUDA in one Triton launch per projection (Punica's segmented
shrink and expand, fused): for each adapter group of the step, block of its tokens and block
of output columns, `x @ A[slot]` (in float32) then `@ B[slot]`, added to the output rows."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _lora_kernel(  # type: ignore[no-untyped-def]
    x_ptr, out_ptr, a_ptr, b_ptr, src_ptr, starts_ptr, slots_ptr,
    in_features, out_features, ranks,
    stride_x, stride_out, stride_a_slot, stride_a_in, stride_b_slot, stride_b_rank,
    RANK: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    group, token_block, column_block = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    start, end = tl.load(starts_ptr + group), tl.load(starts_ptr + group + 1)
    rows = start + token_block * BLOCK_T + tl.arange(0, BLOCK_T)
    row_mask = rows < end
    tokens = tl.load(src_ptr + rows, mask=row_mask, other=0)
    slot = tl.load(slots_ptr + group)
    rank = tl.arange(0, RANK)
    shrunk = tl.zeros((BLOCK_T, RANK), dtype=tl.float32)
    for k0 in range(0, in_features, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(
            x_ptr + tokens[:, None] * stride_x + k[None, :],
            mask=row_mask[:, None] & (k[None, :] < in_features),
            other=0.0,
        )
        a = tl.load(
            a_ptr + slot * stride_a_slot + k[:, None] * stride_a_in + rank[None, :],
            mask=(k[:, None] < in_features) & (rank[None, :] < ranks),
            other=0.0,
        )
        shrunk += tl.dot(x.to(tl.float32), a.to(tl.float32))
    columns = column_block * BLOCK_N + tl.arange(0, BLOCK_N)
    b = tl.load(
        b_ptr + slot * stride_b_slot + rank[:, None] * stride_b_rank + columns[None, :],
        mask=(rank[:, None] < ranks) & (columns[None, :] < out_features),
        other=0.0,
    )
    update = tl.dot(shrunk, b.to(tl.float32))
    out_ptrs = out_ptr + tokens[:, None] * stride_out + columns[None, :]
    mask = row_mask[:, None] & (columns[None, :] < out_features)
    before = tl.load(out_ptrs, mask=mask, other=0.0)
    tl.store(out_ptrs, (before.to(tl.float32) + update).to(out_ptr.dtype.element_ty), mask=mask)


def add_lora(
    x: torch.Tensor,
    out: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    src: torch.Tensor,
    starts: torch.Tensor,
    slots: torch.Tensor,
    max_width: int,
) -> torch.Tensor:
    """`out[src] += x[src] @ a[slot] @ b[slot]`, group by group: group g's tokens are
    `src[starts[g]:starts[g + 1]]` (at most `max_width`), its slot `slots[g]`. `x` [T, in] and
    `out` [T, out] row-major; `a` [slots, in, R], `b` [slots, R, out]."""
    ranks, out_features = a.shape[2], b.shape[2]
    block_t, block_n = 16, 64
    grid = (slots.shape[0], triton.cdiv(max_width, block_t), triton.cdiv(out_features, block_n))
    _lora_kernel[grid](
        x,
        out,
        a,
        b,
        src,
        starts,
        slots,
        x.shape[1],
        out_features,
        ranks,
        x.stride(0),
        out.stride(0),
        a.stride(0),
        a.stride(1),
        b.stride(0),
        b.stride(1),
        RANK=max(16, triton.next_power_of_2(ranks)),
        BLOCK_T=block_t,
        BLOCK_K=32,
        BLOCK_N=block_n,
    )
    return out
