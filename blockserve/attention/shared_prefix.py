"""Attention for many sequences extending one shared cached prefix, reading that prefix once."""

from __future__ import annotations

import statistics
from dataclasses import dataclass

import torch

from blockserve.attention.common_blocks import BlockSet, PackedCommonBlocks
from blockserve.attention.metadata import AttentionMetadata
from blockserve.kernels import CpuKernels


def attend(
    q: torch.Tensor,  # [..., queries, dim]
    k: torch.Tensor,  # [..., keys, dim]
    v: torch.Tensor,  # [..., keys, dim]
    mask: torch.Tensor | None = None,  # broadcastable to [..., queries, keys], True = attend
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention in float32, with the log-sum-exp of the scores for merging."""
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * q.shape[-1] ** -0.5
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [..., queries]
    return torch.matmul(torch.exp(scores - lse.unsqueeze(-1)), v.float()), lse


# torch's fused CPU attention kernel, in the variant that also returns the log-sum-exp (the
# public scaled_dot_product_attention drops it): faster than explicit float32 scores
# (docs/benchmarks/core.md). Absent (other builds, other devices) → the explicit path.
_FUSED_CPU_WITH_LSE = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


Partial = tuple[torch.Tensor, torch.Tensor]  # attention over some keys: output, log-sum-exp


def attend_heads(
    q: torch.Tensor,  # [batch, heads, queries, dim]
    k: torch.Tensor,  # [batch, heads, keys, dim]
    v: torch.Tensor,
    mask: torch.Tensor | None = None,  # bool, broadcastable to [batch, heads, queries, keys]
    lengths: torch.Tensor | None = None,  # [batch, queries]: `mask` as key counts, if known
    prior: Partial | None = None,  # the rows over other keys: [batch, heads, queries, (dim)]
    kernels: CpuKernels | None = None,  # ours, where loaded; None: torch's
) -> Partial:
    """`attend` for 4-D inputs with as many K/V heads as query heads: our CPU kernel (bf16
    or float32) with head dimension 64 where `kernels` has it loaded and
    every row sees a prefix of the keys (`lengths`, or found from `mask`), else torch's fused
    CPU kernel where it exists (outputs float32 like `attend`), else the explicit path. With
    a `prior` (float32) the result covers its keys too: our kernel continues each row's
    softmax from it, the other paths merge the two."""
    if _FUSED_CPU_WITH_LSE is None or q.device.type != "cpu":
        return including(prior, *attend(q, k, v, mask))
    kernel = None if kernels is None else kernels.dense_attention(q)
    if kernel is not None:
        if mask is not None and lengths is None:
            lengths = prefix_lengths(mask, q.shape[0], q.shape[2], k.shape[2])
        if mask is None or lengths is not None:
            return kernel(q, k, v, lengths, q.shape[-1] ** -0.5, *(prior or ()))
    additive = None
    if mask is not None:
        additive = torch.zeros(mask.shape, dtype=q.dtype, device=q.device)
        additive.masked_fill_(~mask, float("-inf"))
    out, lse = _FUSED_CPU_WITH_LSE(q, k, v, attn_mask=additive)
    return including(prior, out.float(), lse)


def including(prior: Partial | None, out: torch.Tensor, lse: torch.Tensor) -> Partial:
    """Attention over some keys (out, lse) merged with a prior over others, if any."""
    if prior is None:
        return out, lse
    return merge(*prior, out, lse), torch.logaddexp(prior[1], lse)


def attend_common_blocks(
    q: torch.Tensor,  # [n, kv_heads, m, dim]: KV head h's queries are q[:, h], n * m of them
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, kv_heads, dim]
    block_ids: torch.Tensor,  # [num_common]
    kept: tuple[PackedCommonBlocks, BlockSet] | None = None,  # where packings are kept
    kernels: CpuKernels | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # [kv_heads, n * m, (dim)] float32
    """`attend_heads` of every query against all keys of whole cached blocks: by our CPU
    kernel where it serves, over the blocks as it packed them (kept across steps in `kept`'s
    store under its block set, if given; else packed for this call) and the queries where
    they are; else gathered first."""
    num_kv_heads, head_dim = q.shape[1], q.shape[3]
    kernel = None if kernels is None else kernels.prefix_attention(q)
    pack = None if kernels is None else kernels.pack_common(q)
    if kernel is not None and pack is not None:
        packed = None if kept is None else kept[0].get(pack, kv_cache, kept[1], block_ids)
        return kernel(q, kv_cache[0], kv_cache[1], block_ids, head_dim**-0.5, packed)
    rows = q.permute(1, 0, 2, 3).reshape(1, num_kv_heads, -1, head_dim)
    k = kv_cache[0].index_select(0, block_ids).reshape(-1, num_kv_heads, head_dim).transpose(0, 1)
    v = kv_cache[1].index_select(0, block_ids).reshape(-1, num_kv_heads, head_dim).transpose(0, 1)
    out, lse = attend_heads(rows, k[None], v[None], kernels=kernels)
    return out[0], lse[0]


def prefix_lengths(mask: torch.Tensor, batch: int, rows: int, keys: int) -> torch.Tensor | None:
    """How many keys each row sees, [batch, rows], if `mask` (the same for every head) shows
    every row a prefix of the keys, as the paths' masks do (a sequence's keys up to the row's
    own position, padding after); else None."""
    if mask.dim() != 4 or mask.shape[1] != 1:
        return None
    rows_mask = mask.expand(batch, 1, rows, keys)[:, 0]
    lengths = rows_mask.sum(-1)
    prefix = torch.arange(keys, device=mask.device) < lengths[..., None]
    return lengths if torch.equal(rows_mask, prefix) else None


def merge(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> torch.Tensor:
    """Combine two partial softmax attentions over disjoint key sets."""
    lse = torch.logaddexp(lse_a, lse_b)
    return out_a * torch.exp(lse_a - lse).unsqueeze(-1) + out_b * torch.exp(lse_b - lse).unsqueeze(
        -1
    )


def num_common_blocks(tables: torch.Tensor, max_common_tokens: int, block_size: int) -> int:
    """Leading block-table columns equal in every row, covering at most max_common_tokens."""
    if tables.shape[0] < 2:
        return 0
    same = (tables == tables[:1]).all(dim=0).int().cumprod(dim=0)
    return min(int(same.sum()), max_common_tokens // block_size)


def rows_to_share(
    metadata: AttentionMetadata, rows: list[int], token_starts: list[int]
) -> tuple[list[int], list[int]]:
    """Of the prefill rows on a cached prefix (and their first tokens), those worth attending
    together: a chunk at most twice the median chunk, on a cached prefix at least half the
    median one. Another row would pad every row's queries to its chunk, or cut the blocks they
    share to its cache: the request computing, in this very step, the prefix the others find
    cached (they share its blocks as they are hashed) is such a row when part of that prefix
    was cached before. It is attended on its own."""
    if len(rows) < 3:  # no median to stand apart from
        return rows, token_starts
    chunks = [metadata.query_lens_cpu[r] for r in rows]
    cached = [metadata.seq_lens_cpu[r] - n for r, n in zip(rows, chunks, strict=True)]
    chunk_limit, cache_limit = 2 * statistics.median_low(chunks), statistics.median_low(cached) / 2
    keep = [i for i in range(len(rows)) if chunks[i] <= chunk_limit and cached[i] >= cache_limit]
    return [rows[i] for i in keep], [token_starts[i] for i in keep]


@dataclass(frozen=True, slots=True)
class SharedPrefixPlan:
    """When several prefill chunks of one step sit on top of the same cached blocks (a shared
    system prompt: each request computes its own question on top of it), per-sequence attention
    reads the prefix once per sequence. Here every query of every such sequence meets the common
    blocks in one matmul per KV head, each sequence's own tokens in one batched matmul, and the
    two softmaxes are merged by their log-sum-exp (as in cascade attention); our CPU kernel
    instead continues each row's softmax over its own tokens from the common blocks' result:

        sequence r: | common blocks (all queries see all of them) | own blocks (causal)  |
                    0                                      common_len             seq_len_r
    """

    token_index: torch.Tensor  # [rows, max_queries]: flat-batch index (padding → 0)
    valid: torch.Tensor  # [rows, max_queries] bool
    common_block_ids: torch.Tensor  # [num_common]
    own_block_ids: torch.Tensor  # [rows * max_own_blocks] (padding → block 0)
    own_mask: torch.Tensor  # [rows, 1, 1, max_queries, max_own_blocks * block_size]
    own_counts: torch.Tensor  # [rows, max_queries]: own keys each query sees (a prefix of them)
    common_set: BlockSet  # common_block_ids as a tuple
    # The flat-batch index of the first query when the rows' queries are one run of the
    # batch, max_queries each (token_index is then that run in order): None otherwise.
    first_token: int | None = None


def plan_shared_prefix(
    metadata: AttentionMetadata, rows: list[int], token_starts: list[int]
) -> SharedPrefixPlan | None:
    """A plan for prefill rows `rows` (with cached prefixes) if they share cached blocks."""
    if len(rows) < 2:
        return None
    block_size = metadata.block_size
    device = metadata.slot_mapping.device
    query_lens = [metadata.query_lens_cpu[r] for r in rows]
    seq_lens = [metadata.seq_lens_cpu[r] for r in rows]
    min_cached = min(s - q for s, q in zip(seq_lens, query_lens, strict=True))
    max_blocks = -(-max(seq_lens) // block_size)
    index = torch.tensor(rows, device=device)
    tables = metadata.block_tables[index, :max_blocks]
    num_common = num_common_blocks(tables, min_cached, block_size)
    if num_common == 0:
        return None
    max_queries = max(query_lens)
    one_run = all(
        n == max_queries and start == token_starts[0] + i * max_queries
        for i, (n, start) in enumerate(zip(query_lens, token_starts, strict=True))
    )
    offsets = torch.arange(max_queries, device=device)
    lens = torch.tensor(query_lens, device=device)
    valid = offsets[None, :] < lens[:, None]  # [rows, max_queries]
    starts = torch.tensor(token_starts, device=device)
    token_index = torch.where(valid, starts[:, None] + offsets[None, :], 0)
    seq_lens_t = torch.tensor(seq_lens, device=device)
    query_pos = (seq_lens_t - lens)[:, None] + offsets[None, :]  # absolute positions
    own = tables[:, num_common:]
    key_pos = num_common * block_size + torch.arange(own.shape[1] * block_size, device=device)
    visible = (key_pos[None, None, :] <= query_pos[:, :, None]) & valid[:, :, None]
    return SharedPrefixPlan(
        token_index=token_index,
        valid=valid,
        common_block_ids=tables[0, :num_common],
        own_block_ids=own.reshape(-1),
        own_mask=visible[:, None, None],  # [rows, 1 (kv head), 1 (group), queries, keys]
        own_counts=visible.sum(-1),
        common_set=tuple(tables[0, :num_common].tolist()),
        first_token=token_starts[0] if one_run else None,
    )


def attend_shared_prefix(
    query: torch.Tensor,  # [num_tokens, heads, dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, kv_heads, dim], this step's K/V written
    plan: SharedPrefixPlan,
    output: torch.Tensor,  # [num_tokens, heads, dim]: the plan's rows are written
    kept: PackedCommonBlocks | None = None,  # the common blocks' packings across steps
    kernels: CpuKernels | None = None,
) -> None:
    rows, max_queries = plan.token_index.shape
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = kv_cache.shape[3]
    group = num_heads // num_kv_heads
    first = plan.first_token
    run = None if first is None else slice(first, first + rows * max_queries)
    # [rows, queries, kv_heads, group, dim]: the rows' queries where they lie when they are
    # one run of the batch, else gathered (padding reads token 0).
    tokens = query[run] if run is not None else query[plan.token_index]
    tokens = tokens.view(rows, max_queries, num_kv_heads, group, head_dim)
    own_k = kv_cache[0][plan.own_block_ids].view(rows, -1, num_kv_heads, head_dim)
    own_v = kv_cache[1][plan.own_block_ids].view(rows, -1, num_kv_heads, head_dim)
    own_k = own_k.permute(0, 2, 1, 3)  # [rows, kv_heads, own_keys, dim]
    own_v = own_v.permute(0, 2, 1, 3)
    # Each KV head's queries become rows, query by query and within a query head by head:
    # [rows, kv_heads, queries * group, dim].
    per_head = max_queries * group
    q_rows = tokens.permute(0, 2, 1, 3, 4).reshape(rows, num_kv_heads, per_head, head_dim)
    own_mask = plan.own_mask.transpose(2, 3).expand(-1, -1, -1, group, -1)
    own_mask = own_mask.reshape(rows, 1, per_head, -1)
    own_counts = plan.own_counts[:, :, None].expand(-1, -1, group).reshape(rows, per_head)
    # Every query of every row against the common keys (the queries as they lie: the same
    # rows in the same order), then its own keys from there on.
    out_common, lse_common = attend_common_blocks(
        tokens.view(rows * max_queries, num_kv_heads, group, head_dim),
        kv_cache,
        plan.common_block_ids,
        None if kept is None else (kept, plan.common_set),
        kernels,
    )
    common = (  # [kv_heads, rows * per_head, (dim)] → [rows, kv_heads, per_head, (dim)]
        out_common.view(num_kv_heads, rows, per_head, head_dim).transpose(0, 1),
        lse_common.view(num_kv_heads, rows, per_head).transpose(0, 1),
    )
    out, _ = attend_heads(q_rows, own_k, own_v, own_mask, own_counts, prior=common, kernels=kernels)
    # [rows, kv_heads, queries, group, dim] → [rows, queries, kv_heads, group, dim]
    out = out.view(rows, num_kv_heads, max_queries, group, head_dim).transpose(1, 2)
    if run is not None:  # one strided copy into place, in the output's dtype
        output[run].view(rows, max_queries, num_kv_heads, group, head_dim).copy_(out)
    else:
        rows_out = out[plan.valid].reshape(-1, num_heads, head_dim)
        output[plan.token_index[plan.valid]] = rows_out.to(output.dtype)
