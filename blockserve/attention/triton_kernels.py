"""Triton kernels: writing K/V into the paged cache, and unified paged attention.

Unified means one launch serves the whole flat batch: prefill chunks on top of cached prefix
blocks and single-token decodes alike. Each program takes a tile of up to BLOCK_M consecutive
query tokens of one sequence and one query head, walks that sequence's block table, and keeps
an online softmax in float32 (scores, running max, running sum and the accumulator), so
float16/bfloat16 inputs never lose precision in the reduction. Causality is by absolute
position: query i of a sequence with `num_cached` earlier tokens sees keys 0..num_cached+i.

Under TRITON_INTERPRET=1 these run on the CPU (float32/float16; the interpreter computes
bfloat16 wrongly), which is how CI tests them.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def reshape_and_cache_kernel(
    key_ptr,  # [num_tokens, kv_heads, head_dim]
    value_ptr,
    key_cache_ptr,  # [num_blocks, block_size, kv_heads, head_dim]
    value_cache_ptr,
    slot_mapping_ptr,  # [num_tokens] int64
    stride_key_token,
    stride_value_token,
    stride_cache_block,
    stride_cache_pos,
    BLOCK_SIZE: tl.constexpr,
    ROW: tl.constexpr,  # kv_heads * head_dim
    ROW_POW2: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token)
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    cols = tl.arange(0, ROW_POW2)
    mask = cols < ROW
    destination = block * stride_cache_block + offset * stride_cache_pos + cols
    key = tl.load(key_ptr + token * stride_key_token + cols, mask=mask)
    value = tl.load(value_ptr + token * stride_value_token + cols, mask=mask)
    tl.store(key_cache_ptr + destination, key, mask=mask)
    tl.store(value_cache_ptr + destination, value, mask=mask)


@triton.jit
def unified_attention_kernel(
    out_ptr,  # [num_tokens, heads, head_dim]
    query_ptr,  # [num_tokens, heads, head_dim]
    key_cache_ptr,  # [num_blocks, block_size, kv_heads, head_dim]
    value_cache_ptr,
    block_tables_ptr,  # [num_seqs, max_blocks]
    seq_lens_ptr,  # [num_seqs]
    query_start_ptr,  # [num_seqs + 1]
    tile_seq_ptr,  # [num_tiles]: the sequence of each tile
    tile_offset_ptr,  # [num_tiles]: its first query within the sequence
    scale,
    stride_query_token,
    stride_query_head,
    stride_out_token,
    stride_out_head,
    stride_cache_block,
    stride_cache_pos,
    stride_cache_head,
    stride_table_seq,
    QUERIES_PER_KV: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    DOT_PRECISION: tl.constexpr,  # "ieee" for float32 (no TF32 rounding); ignored for 16-bit
):
    tile = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // QUERIES_PER_KV
    seq = tl.load(tile_seq_ptr + tile)
    first = tl.load(tile_offset_ptr + tile)
    query_start = tl.load(query_start_ptr + seq)
    query_len = tl.load(query_start_ptr + seq + 1) - query_start
    seq_len = tl.load(seq_lens_ptr + seq)
    num_cached = seq_len - query_len

    rows = first + tl.arange(0, BLOCK_M)  # query index within the sequence
    row_valid = rows < query_len
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(
        query_ptr
        + (query_start + rows)[:, None] * stride_query_token
        + head * stride_query_head
        + dims[None, :],
        mask=row_valid[:, None],
        other=0.0,
    )
    positions = num_cached + rows  # absolute position of each query

    running_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    running_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    # Keys up to the last valid query of this tile.
    last_key = num_cached + tl.minimum(first + BLOCK_M, query_len)
    num_blocks = tl.cdiv(last_key, BLOCK_SIZE)
    slots = tl.arange(0, BLOCK_SIZE)
    for b in range(0, num_blocks):
        block_id = tl.load(block_tables_ptr + seq * stride_table_seq + b)
        base = block_id * stride_cache_block + kv_head * stride_cache_head
        offsets = base + slots[:, None] * stride_cache_pos + dims[None, :]
        k = tl.load(key_cache_ptr + offsets)  # [BLOCK_SIZE, HEAD_DIM]
        v = tl.load(value_cache_ptr + offsets)
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION).to(tl.float32) * scale
        key_positions = b * BLOCK_SIZE + slots
        visible = (key_positions[None, :] <= positions[:, None]) & row_valid[:, None]
        # Rows past the sequence see nothing; give them finite scores so no NaN appears.
        scores = tl.where(visible, scores, float("-inf"))
        scores = tl.where(row_valid[:, None], scores, 0.0)
        new_max = tl.maximum(running_max, tl.max(scores, axis=1))
        probs = tl.exp(scores - new_max[:, None])
        correction = tl.exp(running_max - new_max)
        running_sum = running_sum * correction + tl.sum(probs, axis=1)
        pv = tl.dot(probs.to(v.dtype), v, input_precision=DOT_PRECISION)
        acc = acc * correction[:, None] + pv.to(tl.float32)
        running_max = new_max

    out = acc / running_sum[:, None]
    tl.store(
        out_ptr
        + (query_start + rows)[:, None] * stride_out_token
        + head * stride_out_head
        + dims[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_valid[:, None],
    )
