"""The torch backend equals dense causal attention for any mix of prefill-on-prefix and decode."""

from __future__ import annotations

import pytest
import torch

from blockserve.attention.batch_split import split_batch
from blockserve.attention.shared_prefix import plan_shared_prefix, prefix_lengths, rows_to_share
from blockserve.attention.torch_backend import TorchAttentionBackend
from tests.attention.cases import make_case, reference_attention

MIXED = [(0, 23), (37, 1), (16, 9), (100, 1), (5, 30), (1, 1)]
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 3e-2}


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(6, 2), (8, 2), (4, 4)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mixed_batch_matches_dense_reference(
    num_heads: int, num_kv_heads: int, dtype: torch.dtype
) -> None:
    """Fresh prefills, prefills on prefixes not multiple of 16, and decodes, with GQA 3:1, 4:1."""
    case = make_case(MIXED, num_heads, num_kv_heads, head_dim=64, dtype=dtype)
    backend = TorchAttentionBackend()
    plan = backend.prepare(case.metadata)
    out = backend.forward(case.query, case.key, case.value, case.kv_cache, plan)
    expected = reference_attention(case)
    assert out.shape == case.query.shape
    assert (out.double() - expected).abs().max().item() < TOLERANCE[dtype]


def test_new_kv_is_written_to_its_slots() -> None:
    """Every new token's K and V land at its slot; other slots are untouched."""
    case = make_case([(3, 5), (20, 1)], 4, 2, head_dim=16)
    before = case.kv_cache.clone()
    backend = TorchAttentionBackend()
    backend.forward(case.query, case.key, case.value, case.kv_cache, backend.prepare(case.metadata))
    flat = case.kv_cache.view(2, -1, 2, 16)
    slots = case.metadata.slot_mapping
    assert torch.equal(flat[0, slots], case.key)
    assert torch.equal(flat[1, slots], case.value)
    untouched = torch.ones(flat.shape[1], dtype=torch.bool)
    untouched[slots] = False
    assert torch.equal(flat[:, untouched], before.view(2, -1, 2, 16)[:, untouched])


def test_decode_only_batch_with_different_lengths() -> None:
    """Decodes of lengths 2..200 padded into one call give each its own context only."""
    case = make_case([(1, 1), (57, 1), (199, 1), (16, 1)], 4, 1, head_dim=32, seed=5)
    backend = TorchAttentionBackend()
    plan = backend.prepare(case.metadata)
    assert plan.decode is not None and plan.decode.own_tables.shape == (4, 13)
    assert plan.decode.common_block_ids is None
    out = backend.forward(case.query, case.key, case.value, case.kv_cache, plan)
    assert (out.double() - reference_attention(case)).abs().max().item() < 1e-5


def test_a_shared_prefix_plan_counts_each_querys_own_keys() -> None:
    """Prefill chunks on one shared prefix: each query sees a prefix of its sequence's own
    keys, counted once in the plan (our CPU kernel takes the counts; torch's the mask)."""
    specs = [(48, 32), (50, 5), (70, 17), (60, 1)]  # the last is a decode: not in the plan
    case = make_case(specs, 6, 2, head_dim=16, shared_blocks=3)
    split = split_batch(case.metadata)
    plan = plan_shared_prefix(case.metadata, split.prefix_rows, split.prefix_token_starts)
    assert plan is not None
    rows, queries = plan.valid.shape
    keys = plan.own_mask.shape[-1]
    found = prefix_lengths(plan.own_mask[:, :, 0], rows, queries, keys)
    assert found is not None and torch.equal(plan.own_counts, found)
    # Query j of a sequence with c cached tokens sees its own keys up to position c + j.
    expected = [[c - 48 + j + 1 if j < n else 0 for j in range(queries)] for c, n in specs[:3]]
    assert plan.own_counts.tolist() == expected


def test_a_long_chunk_on_a_short_cache_is_attended_alone() -> None:
    """The request computing a prefix that the others already share (a long chunk on a short
    cache) stays out of the shared-prefix plan, which would pad every row to its chunk; the
    rows sharing blocks go together, and the output is still exact."""
    specs = [(16, 100), (64, 8), (70, 5), (80, 8), (40, 1)]  # the last is a decode
    case = make_case(specs, 6, 2, head_dim=64, shared_blocks=4)
    backend = TorchAttentionBackend()
    plan = backend.prepare(case.metadata)
    assert plan.shared_prefix is not None
    assert plan.shared_prefix.valid.shape == (3, 8)  # rows 1-3, padded to 8 queries, not 100
    assert [(p.token_start, p.token_end) for p in plan.prefills] == [(0, 100)]
    out = backend.forward(case.query, case.key, case.value, case.kv_cache, plan)
    assert (out.double() - reference_attention(case)).abs().max().item() < 1e-5


def test_rows_that_would_pad_or_cut_the_others_are_left_out() -> None:
    """Chunks above twice the median, or cached prefixes below half the median, stay out."""
    specs = [(64, 8), (64, 40), (64, 16), (16, 8), (64, 17), (48, 8)]  # (cached, chunk)
    case = make_case(specs, 2, 1, head_dim=16)
    rows = list(range(len(specs)))
    starts = case.metadata.query_start_loc[:-1].tolist()
    # median chunk 8 → limit 16 (row 1's 40 and row 4's 17 out); median cached 64 → 32
    # (row 3's 16 out; row 5's 48 stays).
    assert rows_to_share(case.metadata, rows, starts) == ([0, 2, 5], [0, 48, 89])
    assert rows_to_share(case.metadata, rows[:2], starts[:2]) == ([0, 1], [0, 8])
