"""The torch attention backend: the CPU path and the reference every other backend must match."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from blockserve.attention.batch_split import all_prefill_plans, split_batch
from blockserve.attention.common_blocks import BlockSet, PackedCommonBlocks
from blockserve.attention.metadata import AttentionMetadata
from blockserve.attention.prefill import PrefillPlan, attend_prefills, prefix_prefill_plan
from blockserve.attention.shared_prefix import (
    SharedPrefixPlan,
    attend_common_blocks,
    attend_heads,
    attend_shared_prefix,
    num_common_blocks,
    plan_shared_prefix,
    rows_to_share,
)
from blockserve.kernels import CpuKernels
from blockserve.kernels.cpu import MAX_DECODE_GROUP


@dataclass(frozen=True, slots=True)
class DecodePlan:
    """All single-token decodes of the step.

    context of row i: | common blocks (shared by every row) | own blocks ... padding |
    """

    token_indices: torch.Tensor  # [num_decodes]: their rows in the flat batch
    common_block_ids: torch.Tensor | None  # [num_common]; None when nothing is shared
    common_set: BlockSet  # common_block_ids as a tuple; () when nothing is shared
    own_tables: torch.Tensor  # [num_decodes, max_own_blocks] int64, padding → block 0
    own_lengths: torch.Tensor  # [num_decodes]: tokens in each sequence's own blocks
    mask: torch.Tensor  # [num_decodes, 1, 1, max_own_blocks * block_size] bool, True = attend


@dataclass(frozen=True, slots=True)
class TorchAttentionPlan:
    slot_mapping: torch.Tensor  # [num_tokens]
    decode: DecodePlan | None
    prefills: tuple[PrefillPlan, ...]
    shared_prefix: SharedPrefixPlan | None = None


class TorchAttentionBackend:
    """Stateless between steps but for a gather workspace, reused so that decode contexts are
    copied into memory already mapped (fresh large allocations fault pages in on every layer),
    and our kernel's packings of common blocks, kept while steps go on reading the same ones
    (common_blocks.py; `forget_kv` when something else writes into the cache).
    Decodes that share blocks take the shared-prefix path when it saves at least
    `min_shared_decode_tokens` key reads, (decodes − 1) × common tokens: by default always, as
    it measured no slower at any batch (bench_shared_decode.py forces either path).

    Handles any mix in one batch: fresh prefills, prefill chunks on cached prefix blocks (causal
    among the new tokens, full over the prefix) and single-token decodes, with GQA. Its per-step
    plan is built once by `prepare` and passed to every layer. Decodes are batched: blocks all
    of them share (a common prompt prefix) are read once for all queries; each sequence's other
    blocks are read in place by our paged-decode kernel (bf16 or float32: blockserve/kernels) or
    else gathered whole into a workspace reused by every layer, their softmax continuing from
    the common blocks' result (merged by log-sum-exp where torch's kernels serve). Each prefill
    sequence gets its own call. Measured choices: docs/benchmarks/core.md.
    """

    name = "torch"

    def __init__(
        self, min_shared_decode_tokens: int = 0, kernels: CpuKernels | None = None
    ) -> None:
        self._workspace: torch.Tensor | None = None
        self.kernels = kernels if kernels is not None else CpuKernels()  # ours, once loaded
        self.min_shared_decode_tokens = min_shared_decode_tokens
        self.common_blocks = PackedCommonBlocks()  # our kernel's packings, across steps

    def forget_kv(self) -> None:
        """Something outside the forward wrote into the KV caches (any thread)."""
        self.common_blocks.forget()

    # -- planning (once per step) ---------------------------------------------------------

    def prepare(self, metadata: AttentionMetadata) -> TorchAttentionPlan:
        split = split_batch(metadata)
        decode = None
        if split.decode_rows:
            decode = self._plan_decodes(metadata, split.decode_rows, split.decode_tokens)
        together, starts = rows_to_share(metadata, split.prefix_rows, split.prefix_token_starts)
        shared = plan_shared_prefix(metadata, together, starts)
        used = [plan.common_set for plan in (decode, shared) if plan is not None]
        self.common_blocks.begin_step(metadata.slot_mapping, metadata.block_size, used)
        if shared is not None:  # prefill chunks on one shared prefix: read it once
            shared_rows = set(together)
            alone = (
                prefix_prefill_plan(metadata, row, start)
                for row, start in zip(split.prefix_rows, split.prefix_token_starts, strict=True)
                if row not in shared_rows
            )
            return TorchAttentionPlan(
                slot_mapping=metadata.slot_mapping,
                decode=decode,
                prefills=(*split.fresh_prefills, *alone),
                shared_prefix=shared,
            )
        return TorchAttentionPlan(
            slot_mapping=metadata.slot_mapping,
            decode=decode,
            prefills=all_prefill_plans(metadata, split),
            shared_prefix=None,
        )

    def _plan_decodes(
        self, metadata: AttentionMetadata, rows_list: list[int], token_indices: list[int]
    ) -> DecodePlan:
        block_size = metadata.block_size
        device = metadata.slot_mapping.device
        rows = torch.tensor(rows_list, device=device)
        seq_lens = [metadata.seq_lens_cpu[r] for r in rows_list]
        max_blocks = -(-max(seq_lens) // block_size)
        tables = metadata.block_tables[rows, :max_blocks]  # [num_decodes, max_blocks]
        # Each decode's last token is its own: the common part ends before it.
        num_common = num_common_blocks(tables, min(seq_lens) - 1, block_size)
        if (len(rows_list) - 1) * num_common * block_size < self.min_shared_decode_tokens:
            num_common = 0
        own = tables[:, num_common:]
        # Position of each gathered key within its sequence; padding reads the null block
        # and is masked out.
        positions = num_common * block_size + torch.arange(own.shape[1] * block_size, device=device)
        decode_lens = metadata.seq_lens[rows]
        mask = (positions[None, :] < decode_lens[:, None])[:, None, None]
        return DecodePlan(
            token_indices=torch.tensor(token_indices, device=device),
            common_block_ids=tables[0, :num_common] if num_common else None,
            common_set=tuple(tables[0, :num_common].tolist()),
            own_tables=own.long().contiguous(),
            own_lengths=decode_lens - num_common * block_size,
            mask=mask,
        )

    # -- the forward (every layer) --------------------------------------------------------

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        plan: TorchAttentionPlan,
    ) -> torch.Tensor:
        num_kv_heads, head_dim = key.shape[1], key.shape[2]
        write = self.kernels.write_kv(kv_cache, plan.slot_mapping, key, value)
        if write is not None:
            write(kv_cache, plan.slot_mapping, key, value)
        else:  # into [slots, kv_heads, dim] views of the K and V caches
            for cache, written in zip(kv_cache, (key, value), strict=True):
                cache.view(-1, num_kv_heads, head_dim).index_copy_(0, plan.slot_mapping, written)

        if plan.decode is not None and plan.decode.token_indices.shape[0] == query.shape[0]:
            return self._decode(query, kv_cache, plan.decode)  # decodes only: rows in order
        output = torch.empty_like(query)
        if plan.decode is not None:
            rows = plan.decode.token_indices
            output[rows] = self._decode(query[rows], kv_cache, plan.decode)
        attend_prefills(query, key, value, kv_cache, plan.prefills, output, self.kernels)
        if plan.shared_prefix is not None:
            attend_shared_prefix(
                query, kv_cache, plan.shared_prefix, output, self.common_blocks, self.kernels
            )
        return output

    def _gather_blocks(self, kv_cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
        """K and V of `block_ids`: [2, len(block_ids), block_size, kv_heads, dim]."""
        shape = (2, block_ids.numel(), *kv_cache.shape[2:])
        size = math.prod(shape)
        workspace = self._workspace
        if (
            workspace is None
            or workspace.numel() < size
            or workspace.dtype != kv_cache.dtype
            or workspace.device != kv_cache.device
        ):
            workspace = torch.empty(size, dtype=kv_cache.dtype, device=kv_cache.device)
            self._workspace = workspace
        gathered = workspace[:size].view(shape)
        torch.index_select(kv_cache[0], 0, block_ids, out=gathered[0])
        torch.index_select(kv_cache[1], 0, block_ids, out=gathered[1])
        return gathered

    def _decode(
        self,
        query: torch.Tensor,  # [num_decodes, heads, dim]
        kv_cache: torch.Tensor,
        plan: DecodePlan,
    ) -> torch.Tensor:  # [num_decodes, heads, dim]
        num_decodes, num_heads, head_dim = query.shape
        num_kv_heads = kv_cache.shape[3]
        group = num_heads // num_kv_heads
        fused = self.kernels.decode_attention(query)
        if fused is not None and group <= MAX_DECODE_GROUP:
            # Our kernels, in one call: the common blocks read once for every decode (packed
            # as kept across steps), then each sequence's own blocks read in place (no
            # gather), continuing from that result (no merge).
            packed = None
            if plan.common_block_ids is not None:
                pack = self.kernels.pack_common(query)
                if pack is not None:
                    packed = self.common_blocks.get(
                        pack, kv_cache, plan.common_set, plan.common_block_ids
                    )
            return fused(
                query,
                kv_cache[0],
                kv_cache[1],
                plan.own_tables,
                plan.own_lengths,
                head_dim**-0.5,
                plan.common_block_ids,
                packed,
            )
        q = query.view(num_decodes, num_kv_heads, group, head_dim)
        context = plan.mask.shape[-1]
        gathered = self._gather_blocks(kv_cache, plan.own_tables.view(-1))
        # [num_decodes, context, kv_heads, dim] → [num_decodes, kv_heads, context, dim]
        k = gathered[0].view(num_decodes, context, num_kv_heads, head_dim).transpose(1, 2)
        v = gathered[1].view(num_decodes, context, num_kv_heads, head_dim).transpose(1, 2)
        if plan.common_block_ids is not None:  # the own blocks continue from the common ones
            common = self._common_prefix(q, kv_cache, plan)
            out, _ = attend_heads(q, k, v, plan.mask, prior=common, kernels=self.kernels)
            return out.reshape(num_decodes, num_heads, head_dim).to(query.dtype)
        if query.dtype == torch.float32:
            # float32: torch's fused kernel is the fastest path measured.
            out = F.scaled_dot_product_attention(
                query.unsqueeze(2), k, v, attn_mask=plan.mask, enable_gqa=True
            )
            return out.squeeze(2)
        # bfloat16: the fused CPU kernel is ~5x slower than two batched matmuls for a single
        # query row, so each KV head's query group is one [group, dim] @ [dim, context] matmul.
        scores = torch.matmul(q, k.contiguous().transpose(-1, -2)) * head_dim**-0.5
        scores = scores.masked_fill(~plan.mask, float("-inf"))  # [decodes, kv, group, context]
        probs = scores.softmax(dim=-1, dtype=torch.float32).to(query.dtype)
        out = torch.matmul(probs, v.contiguous())  # [decodes, kv_heads, group, dim]
        return out.reshape(num_decodes, num_heads, head_dim)

    def _common_prefix(
        self,
        q: torch.Tensor,  # [num_decodes, kv_heads, group, dim]
        kv_cache: torch.Tensor,
        plan: DecodePlan,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # [decodes, kv_heads, group, (dim)] float32
        """Every decode's attention over the common blocks, read once for all of them: each
        KV head's queries of every sequence as rows of one call."""
        assert plan.common_block_ids is not None
        num_decodes, num_kv_heads, group, head_dim = q.shape
        out, lse = attend_common_blocks(
            q, kv_cache, plan.common_block_ids, (self.common_blocks, plan.common_set), self.kernels
        )
        out = out.view(num_kv_heads, num_decodes, group, head_dim).transpose(0, 1)
        return out, lse.view(num_kv_heads, num_decodes, group).transpose(0, 1)
