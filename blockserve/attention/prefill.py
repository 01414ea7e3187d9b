"""Prefills one sequence at a time: fresh ones (causal over their own tokens) and chunks on
top of cached blocks (all of those, then causal over the new tokens). The torch and cuda
backends both use this; a step's prefills on one shared prefix take shared_prefix.py instead.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from blockserve.attention.metadata import AttentionMetadata
from blockserve.kernels import CpuKernels


@dataclass(frozen=True, slots=True)
class PrefillPlan:
    """One prefill sequence: its query tokens and, when it extends a cached prefix, its context."""

    token_start: int
    token_end: int
    context_slots: torch.Tensor | None  # [context_len] int64; None: no prefix, use K/V as given
    mask: torch.Tensor | None  # [query_len, context_len] bool, True = attend


def context_slots(block_table: torch.Tensor, num_positions: int, block_size: int) -> torch.Tensor:
    """Cache slots of positions 0..num_positions-1 of a sequence: [num_positions] int64."""
    positions = torch.arange(num_positions, device=block_table.device)
    return block_table[positions // block_size] * block_size + positions % block_size


def prefix_prefill_plan(metadata: AttentionMetadata, row: int, token_start: int) -> PrefillPlan:
    """One prefill chunk on top of cached blocks: its context slots and causal mask."""
    query_len, seq_len = metadata.query_lens_cpu[row], metadata.seq_lens_cpu[row]
    device = metadata.slot_mapping.device
    slots = context_slots(metadata.block_tables[row], seq_len, metadata.block_size)
    # Query i sits at absolute position num_cached + i and sees keys 0..that position.
    query_pos = torch.arange(seq_len - query_len, seq_len, device=device)
    mask = torch.arange(seq_len, device=device)[None, :] <= query_pos[:, None]
    return PrefillPlan(
        token_start=token_start, token_end=token_start + query_len, context_slots=slots, mask=mask
    )


def attend_prefills(
    query: torch.Tensor,  # [num_tokens, heads, dim]
    key: torch.Tensor,  # [num_tokens, kv_heads, dim]
    value: torch.Tensor,
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, kv_heads, dim], this step's K/V written
    prefills: tuple[PrefillPlan, ...],
    output: torch.Tensor,  # [num_tokens, heads, dim]: the prefill rows are written
    kernels: CpuKernels | None = None,  # ours, where loaded; None: torch's
) -> None:
    """Each prefill sequence's queries over its context: our CPU kernel where it serves,
    else torch's fused attention.

    4-D inputs throughout: with 3-D ones torch's CPU kernel falls back to its slow math path.
    """
    if not prefills:
        return
    num_kv_heads, head_dim = key.shape[1], key.shape[2]
    key_cache = kv_cache[0].view(-1, num_kv_heads, head_dim)
    value_cache = kv_cache[1].view(-1, num_kv_heads, head_dim)
    kernel = None if kernels is None else kernels.dense_attention(query)
    for prefill in prefills:
        start, end = prefill.token_start, prefill.token_end
        if kernel is not None:
            slots = prefill.context_slots
            # index_select, not key_cache[slots]: a quarter of advanced indexing's time on CPU.
            k3 = key[start:end] if slots is None else key_cache.index_select(0, slots)
            v3 = value[start:end] if slots is None else value_cache.index_select(0, slots)
            attend_causal(kernel, query[start:end], k3, v3, into=output[start:end])
            continue
        q = query[start:end].transpose(0, 1).unsqueeze(0)  # [1, heads, query_len, dim]
        if prefill.context_slots is None:
            k = key[start:end].transpose(0, 1).unsqueeze(0)  # [1, kv_heads, query_len, dim]
            v = value[start:end].transpose(0, 1).unsqueeze(0)
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:
            k = key_cache.index_select(0, prefill.context_slots)  # [ctx, kv, d]
            v = value_cache.index_select(0, prefill.context_slots)
            k, v = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)  # [1, kv, ctx, d]
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=prefill.mask, enable_gqa=True)
        output[start:end] = out[0].transpose(0, 1)


@functools.lru_cache(maxsize=64)
def causal_counts(
    context_len: int, query_len: int, group: int, device: torch.device
) -> torch.Tensor:
    """[1, group * query_len]: row (g, i) sees context_len - query_len + i + 1 keys. The same in
    every layer of a step, so made once (read only)."""
    seen = torch.arange(context_len - query_len + 1, context_len + 1, device=device)
    return seen.repeat(group).unsqueeze(0)


def attend_causal(
    kernel: Callable[..., tuple[torch.Tensor, torch.Tensor]],
    query: torch.Tensor,  # [query_len, heads, dim]: the last query_len positions of the context
    key: torch.Tensor,  # [context_len, kv_heads, dim]
    value: torch.Tensor,
    into: torch.Tensor | None = None,  # [query_len, heads, dim], any strides: where to write
) -> torch.Tensor:  # [query_len, heads, dim], in query's dtype (`into` where given)
    """Query i sees keys 0 .. context_len - query_len + i, through our CPU kernel: each KV
    head's group of query heads folded into rows, each row given its count of keys. The
    kernel's float32 rows go to `into` in one pass (reordered and rounded as they are copied)."""
    query_len, num_heads, head_dim = query.shape
    context_len, num_kv_heads = key.shape[0], key.shape[1]
    group = num_heads // num_kv_heads
    rows = query.view(query_len, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)
    rows = rows.reshape(1, num_kv_heads, group * query_len, head_dim)
    out, _ = kernel(
        rows,
        key.transpose(0, 1).unsqueeze(0),  # read in place
        value.transpose(0, 1).unsqueeze(0),
        causal_counts(context_len, query_len, group, query.device),
        head_dim**-0.5,
    )
    if into is None:
        into = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    by_position = out.view(num_kv_heads, group, query_len, head_dim).permute(2, 0, 1, 3)
    into.unflatten(1, (num_kv_heads, group)).copy_(by_position)
    return into
