"""Triton kernels: writing K/V into the paged cache, and unified paged attention."""

from __future__ import annotations

import triton
import triton.language as tl

# Unified means one launch serves the whole flat batch: prefill chunks on top of cached prefix
# blocks and single-token decodes alike. Each program owns one KV head and a tile of up to BLOCK_Q
# consecutive query tokens of one sequence; its BLOCK_M rows are those tokens times the
# QUERIES_PER_KV query heads that share the KV head (row r is token r // QUERIES_PER_KV, head r %
# QUERIES_PER_KV of the group), so each K/V tile is read once per group, not once per query head.
# Keys are walked TILE_N at a time, gathered through the block table, with an online softmax in
# float32 (scores, running max, running sum and the accumulator): float16/bfloat16 inputs never
# lose precision in the reduction. Causality is by absolute position: query i of a sequence with
# `num_cached` earlier tokens sees keys 0..num_cached+i.
#
# Split-KV: when the batch has too few (tile, KV head) programs to fill the device (a few long
# decodes), a third grid axis cuts each program's key range into NUM_SPLITS parts; each part
# writes its unnormalised accumulator, max and sum in float32, and `merge_splits_kernel` combines
# them. With NUM_SPLITS == 1 the attention kernel writes the output itself.
#
# The token count and the block table's row stride are not specialized on (Triton would compile
# a variant for 1 and for multiples of 16): a batch's size or its longest context never
# compiles a kernel anew once the engine is ready.
#
# Under TRITON_INTERPRET=1 these run on the CPU (float32/float16; the interpreter computes
# bfloat16 wrongly), which is how CI tests them; CI also compiles them for sm_90.


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


@triton.jit(do_not_specialize=["num_tokens", "stride_table_seq"])
def unified_attention_kernel(
    out_ptr,  # [num_tokens, heads, head_dim]; written when NUM_SPLITS == 1
    partial_ptr,  # [NUM_SPLITS, num_tokens, heads, head_dim] float32; when NUM_SPLITS > 1
    partial_max_ptr,  # [NUM_SPLITS, num_tokens, heads] float32
    partial_sum_ptr,  # [NUM_SPLITS, num_tokens, heads] float32
    query_ptr,  # [num_tokens, heads, head_dim]
    key_cache_ptr,  # [num_blocks, block_size, kv_heads, head_dim]
    value_cache_ptr,
    block_tables_ptr,  # [num_seqs, max_blocks]
    seq_lens_ptr,  # [num_seqs]
    query_start_ptr,  # [num_seqs + 1]
    tile_seq_ptr,  # [num_tiles]: the sequence of each tile
    tile_offset_ptr,  # [num_tiles]: its first query within the sequence
    scale,
    num_tokens,
    num_heads,
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
    BLOCK_Q: tl.constexpr,  # query tokens per tile; BLOCK_Q * QUERIES_PER_KV <= BLOCK_M
    BLOCK_M: tl.constexpr,  # rows per program, a power of two >= 16 (tl.dot's minimum)
    TILE_N: tl.constexpr,  # keys per loop iteration, a multiple of BLOCK_SIZE
    NUM_SPLITS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,  # "ieee" for float32 (no TF32 rounding); ignored for 16-bit
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq = tl.load(tile_seq_ptr + tile)
    first = tl.load(tile_offset_ptr + tile)
    query_start = tl.load(query_start_ptr + seq)
    query_len = tl.load(query_start_ptr + seq + 1) - query_start
    seq_len = tl.load(seq_lens_ptr + seq)
    num_cached = seq_len - query_len

    rows = tl.arange(0, BLOCK_M)
    query_index = first + rows // QUERIES_PER_KV  # query token within the sequence
    head = kv_head * QUERIES_PER_KV + rows % QUERIES_PER_KV
    row_valid = (rows < BLOCK_Q * QUERIES_PER_KV) & (query_index < query_len)
    token = query_start + query_index
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(
        query_ptr
        + token[:, None] * stride_query_token
        + head[:, None] * stride_query_head
        + dims[None, :],
        mask=row_valid[:, None],
        other=0.0,
    )
    positions = num_cached + query_index  # absolute position of each query

    # This program's keys: its split of 0 .. (position of the tile's last valid query).
    keys_end = num_cached + tl.minimum(first + BLOCK_Q, query_len)
    keys_per_split = tl.cdiv(tl.cdiv(keys_end, NUM_SPLITS), TILE_N) * TILE_N
    key_start = split * keys_per_split
    key_stop = tl.minimum(keys_end, key_start + keys_per_split)

    running_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    running_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    slots = tl.arange(0, TILE_N)
    table = block_tables_ptr + seq * stride_table_seq
    for tile_start in range(key_start, key_stop, TILE_N):
        key_index = tile_start + slots
        key_valid = key_index < key_stop
        block_id = tl.load(table + key_index // BLOCK_SIZE, mask=key_valid, other=0)
        offsets = (
            block_id[:, None] * stride_cache_block
            + (key_index % BLOCK_SIZE)[:, None] * stride_cache_pos
            + kv_head * stride_cache_head
            + dims[None, :]
        )
        k = tl.load(key_cache_ptr + offsets, mask=key_valid[:, None], other=0.0)
        v = tl.load(value_cache_ptr + offsets, mask=key_valid[:, None], other=0.0)
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION).to(tl.float32) * scale
        visible = (key_index[None, :] <= positions[:, None]) & key_valid[None, :]
        scores = tl.where(visible & row_valid[:, None], scores, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, axis=1))
        # A row that has seen no visible key yet keeps a max of -inf; subtract 0 instead so
        # exp gives 0 (not NaN) for its scores and its correction.
        base = tl.where(new_max == float("-inf"), 0.0, new_max)
        probs = tl.exp(scores - base[:, None])
        correction = tl.exp(running_max - base)
        running_sum = running_sum * correction + tl.sum(probs, axis=1)
        pv = tl.dot(probs.to(v.dtype), v, input_precision=DOT_PRECISION)
        acc = acc * correction[:, None] + pv.to(tl.float32)
        running_max = new_max

    if NUM_SPLITS == 1:
        # Every valid row saw key 0, so its sum is positive; padding rows are not stored.
        out = acc / tl.where(row_valid, running_sum, 1.0)[:, None]
        tl.store(
            out_ptr
            + token[:, None] * stride_out_token
            + head[:, None] * stride_out_head
            + dims[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=row_valid[:, None],
        )
    else:
        stat = (split * num_tokens + token) * num_heads + head  # [BLOCK_M]
        tl.store(partial_max_ptr + stat, running_max, mask=row_valid)
        tl.store(partial_sum_ptr + stat, running_sum, mask=row_valid)
        tl.store(
            partial_ptr + stat[:, None] * HEAD_DIM + dims[None, :], acc, mask=row_valid[:, None]
        )


@triton.jit(do_not_specialize=["num_tokens"])
def merge_splits_kernel(
    out_ptr,  # [num_tokens, heads, head_dim]
    partial_ptr,  # [NUM_SPLITS, num_tokens, heads, head_dim] float32
    partial_max_ptr,  # [NUM_SPLITS, num_tokens, heads] float32
    partial_sum_ptr,
    num_tokens,
    num_heads,
    stride_out_token,
    stride_out_head,
    HEAD_DIM: tl.constexpr,
    NUM_SPLITS: tl.constexpr,  # a power of two
):
    token = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, NUM_SPLITS)
    stat = (splits * num_tokens + token) * num_heads + head
    split_max = tl.load(partial_max_ptr + stat)  # -inf for a split with no visible key
    split_sum = tl.load(partial_sum_ptr + stat)
    overall_max = tl.max(split_max, axis=0)  # finite: split 0 holds key 0
    weight = tl.exp(split_max - overall_max)
    dims = tl.arange(0, HEAD_DIM)
    partial = tl.load(partial_ptr + stat[:, None] * HEAD_DIM + dims[None, :])
    out = tl.sum(partial * weight[:, None], axis=0) / tl.sum(split_sum * weight, axis=0)
    tl.store(
        out_ptr + token * stride_out_token + head * stride_out_head + dims,
        out.to(out_ptr.dtype.element_ty),
    )
