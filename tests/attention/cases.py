"""Random paged-attention cases and a naive reference, shared by every backend's tests."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch

from blockserve.attention.metadata import AttentionMetadata


@dataclass
class AttentionCase:
    query: torch.Tensor  # [num_tokens, heads, dim]
    key: torch.Tensor  # [num_tokens, kv_heads, dim]
    value: torch.Tensor
    kv_cache: torch.Tensor  # [2, num_blocks, block_size, kv_heads, dim], prefixes pre-filled
    metadata: AttentionMetadata
    contexts: list[tuple[torch.Tensor, torch.Tensor]]  # per sequence: full K, V [seq_len, kv, d]

    def to(self, device: str) -> AttentionCase:
        """The same case with every tensor on `device` (the reference stays computable)."""
        m = self.metadata
        metadata = AttentionMetadata(
            m.slot_mapping.to(device),
            m.block_tables.to(device),
            m.query_start_loc.to(device),
            m.seq_lens.to(device),
            m.query_lens_cpu,
            m.seq_lens_cpu,
            m.block_size,
        )
        return AttentionCase(
            self.query.to(device),
            self.key.to(device),
            self.value.to(device),
            self.kv_cache.to(device),
            metadata,
            self.contexts,
        )


def make_case(
    specs: list[tuple[int, int]],  # per sequence: (num_cached_tokens, query_len)
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype = torch.float32,
    shared_blocks: int = 0,
    seed: int = 0,
) -> AttentionCase:
    """Sequences with cached prefixes already in a shuffled paged cache, plus new tokens.

    The first `shared_blocks` blocks of every sequence whose cached tokens cover them are the
    same physical blocks (a common prompt prefix).
    """
    block_size = 16
    gen = torch.Generator().manual_seed(seed)
    blocks_needed = [math.ceil((c + q) / block_size) for c, q in specs]
    num_blocks = sum(blocks_needed) + 3
    permutation = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()  # never block 0
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    kv_cache = kv_cache.to(dtype)
    shared_table = [permutation.pop() for _ in range(shared_blocks)]
    shared_len = shared_blocks * block_size
    shared_k = torch.randn(shared_len, num_kv_heads, head_dim, generator=gen).to(dtype)
    shared_v = torch.randn(shared_len, num_kv_heads, head_dim, generator=gen).to(dtype)
    tables, queries, keys, values, slots, contexts = [], [], [], [], [], []
    for (num_cached, query_len), n in zip(specs, blocks_needed, strict=True):
        shares = num_cached >= shared_len  # only sequences whose cache covers the prefix share
        own = [permutation.pop() for _ in range(n - shared_blocks if shares else n)]
        table = shared_table + own if shares else own
        tables.append(table)
        seq_len = num_cached + query_len
        full_k = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen).to(dtype)
        full_v = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen).to(dtype)
        if shares:
            full_k[:shared_len], full_v[:shared_len] = shared_k, shared_v
        for pos in range(num_cached):  # the prefix was written in earlier steps
            block, offset = table[pos // block_size], pos % block_size
            kv_cache[0, block, offset] = full_k[pos]
            kv_cache[1, block, offset] = full_v[pos]
        slots += [
            table[p // block_size] * block_size + p % block_size for p in range(num_cached, seq_len)
        ]
        queries.append(torch.randn(query_len, num_heads, head_dim, generator=gen).to(dtype))
        keys.append(full_k[num_cached:])
        values.append(full_v[num_cached:])
        contexts.append((full_k, full_v))
    max_blocks = max(blocks_needed)
    query_lens = [q for _, q in specs]
    seq_lens = [c + q for c, q in specs]
    metadata = AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        block_tables=torch.tensor([t + [0] * (max_blocks - len(t)) for t in tables]),
        query_start_loc=torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()]),
        seq_lens=torch.tensor(seq_lens),
        query_lens_cpu=tuple(query_lens),
        seq_lens_cpu=tuple(seq_lens),
        block_size=block_size,
    )
    return AttentionCase(
        torch.cat(queries), torch.cat(keys), torch.cat(values), kv_cache, metadata, contexts
    )


def reference_attention(case: AttentionCase) -> torch.Tensor:
    """Causal attention by absolute position, computed densely in float64 per sequence."""
    outputs = []
    start = 0
    num_heads = case.query.shape[1]
    for (full_k, full_v), query_len in zip(
        case.contexts, case.metadata.query_lens_cpu, strict=True
    ):
        q = case.query[start : start + query_len].double().cpu()  # [q, heads, dim]
        group = num_heads // full_k.shape[1]
        k = full_k.double().repeat_interleave(group, dim=1)  # [seq, heads, dim]
        v = full_v.double().repeat_interleave(group, dim=1)
        seq_len = k.shape[0]
        scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(q.shape[-1])
        query_pos = torch.arange(seq_len - query_len, seq_len)
        visible = torch.arange(seq_len)[None, :] <= query_pos[:, None]
        scores = scores.masked_fill(~visible, float("-inf"))
        outputs.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), v))
        start += query_len
    return torch.cat(outputs)


def make_bench_case(
    specs: list[tuple[int, int]],  # per sequence: (num_cached_tokens, query_len)
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    device: str = "cuda",
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
    """query, key, value, kv_cache and metadata for `specs`, built on `device` for benchmarks:
    random cache contents, each sequence's blocks scattered at random, no reference kept
    (make_case's per-token bookkeeping would take minutes at batch 256 x 8k)."""
    block_size = 16
    gen = torch.Generator(device=device).manual_seed(seed)
    blocks_needed = [math.ceil((c + q) / block_size) for c, q in specs]
    num_blocks = sum(blocks_needed) + 1  # block 0 stays the null block
    shape = (2, num_blocks, block_size, num_kv_heads, head_dim)
    kv_cache = torch.randn(shape, generator=gen, device=device, dtype=dtype)
    order = torch.randperm(num_blocks - 1, generator=gen, device=device) + 1
    max_blocks = max(blocks_needed)
    block_tables = torch.zeros(len(specs), max_blocks, dtype=torch.int64, device=device)
    slots, start = [], 0
    for row, ((num_cached, query_len), n) in enumerate(zip(specs, blocks_needed, strict=True)):
        block_tables[row, :n] = order[start : start + n]
        start += n
        positions = torch.arange(num_cached, num_cached + query_len, device=device)
        blocks = block_tables[row, positions // block_size]
        slots.append(blocks * block_size + positions % block_size)
    query_lens = [q for _, q in specs]
    seq_lens = [c + q for c, q in specs]
    num_tokens = sum(query_lens)
    query_start = [0, *itertools.accumulate(query_lens)]
    metadata = AttentionMetadata(
        slot_mapping=torch.cat(slots),
        block_tables=block_tables,
        query_start_loc=torch.tensor(query_start, device=device),
        seq_lens=torch.tensor(seq_lens, device=device),
        query_lens_cpu=tuple(query_lens),
        seq_lens_cpu=tuple(seq_lens),
        block_size=block_size,
    )
    query = torch.randn(num_tokens, num_heads, head_dim, generator=gen, device=device, dtype=dtype)
    key = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen, device=device, dtype=dtype)
    value = torch.randn_like(key)
    return query, key, value, kv_cache, metadata
