"""A step's sequences by kind, as the backends that attend them one by one need them: decodes,
fresh prefills, and prefill chunks on a cached prefix (with the plan each of those needs)."""

from __future__ import annotations

from typing import NamedTuple

from blockserve.attention.metadata import AttentionMetadata
from blockserve.attention.prefill import PrefillPlan, prefix_prefill_plan


class BatchSplit(NamedTuple):
    """A step's sequences by kind: decodes, fresh prefills, prefills on a cached prefix."""

    decode_rows: list[int]
    decode_tokens: list[int]  # flat-batch index of each decode's query
    fresh_prefills: list[PrefillPlan]
    prefix_rows: list[int]
    prefix_token_starts: list[int]


def split_batch(metadata: AttentionMetadata) -> BatchSplit:
    split = BatchSplit(
        decode_rows=[], decode_tokens=[], fresh_prefills=[], prefix_rows=[], prefix_token_starts=[]
    )
    token_start = 0
    for row, (query_len, seq_len) in enumerate(
        zip(metadata.query_lens_cpu, metadata.seq_lens_cpu, strict=True)
    ):
        num_cached = seq_len - query_len
        if query_len == 1 and num_cached > 0:
            split.decode_rows.append(row)
            split.decode_tokens.append(token_start)
        elif num_cached == 0:
            split.fresh_prefills.append(
                PrefillPlan(
                    token_start=token_start,
                    token_end=token_start + query_len,
                    context_slots=None,
                    mask=None,
                )
            )
        else:
            split.prefix_rows.append(row)
            split.prefix_token_starts.append(token_start)
        token_start += query_len
    return split


def all_prefill_plans(metadata: AttentionMetadata, split: BatchSplit) -> tuple[PrefillPlan, ...]:
    return (
        *split.fresh_prefills,
        *(
            prefix_prefill_plan(metadata, r, t)
            for r, t in zip(split.prefix_rows, split.prefix_token_starts, strict=True)
        ),
    )
