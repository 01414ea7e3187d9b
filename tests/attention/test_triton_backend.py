"""The Triton kernels equal the torch backend (on the CPU: under TRITON_INTERPRET=1, in
float32 and float16; the interpreter computes bfloat16 wrongly)."""

from __future__ import annotations

import pytest
import torch

from blockserve.attention.torch_backend import TorchAttentionBackend
from blockserve.attention.triton_backend import (
    TritonAttentionBackend,
    reshape_and_cache,
    unified_attention,
)
from tests.attention.cases import make_case, reference_attention

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Fresh prefill, decodes, prefills on prefixes of 37 and 5 tokens (not multiples of 16).
MIXED = [(0, 23), (37, 1), (16, 9), (5, 30), (50, 1)]
TOLERANCE = {torch.float32: 2e-5, torch.float16: 2e-3}


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(6, 2), (8, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_unified_attention_matches_torch_backend(
    num_heads: int, num_kv_heads: int, dtype: torch.dtype
) -> None:
    """Mixed prefill-on-prefix and decode, GQA 3:1 and 4:1, head_dim 64: equal within tolerance."""
    case = make_case(MIXED, num_heads, num_kv_heads, head_dim=64, dtype=dtype, seed=7).to(DEVICE)
    torch_cache = case.kv_cache.clone()
    backend = TritonAttentionBackend()
    plan = backend.prepare(case.metadata)
    reshape_and_cache(case.key, case.value, case.kv_cache, case.metadata.slot_mapping)
    out = torch.full_like(case.query, float("nan"))  # poisoned: unwritten elements fail
    unified_attention(case.query, case.kv_cache, plan, out)
    torch_backend = TorchAttentionBackend()
    expected = torch_backend.forward(
        case.query, case.key, case.value, torch_cache, torch_backend.prepare(case.metadata)
    )
    assert not torch.isnan(out).any()
    assert (out.float() - expected.float()).abs().max().item() < TOLERANCE[dtype]
    reference = reference_attention(case)
    assert (out.double().cpu() - reference).abs().max().item() < TOLERANCE[dtype] * 2
    assert torch.equal(case.kv_cache, torch_cache)  # both wrote the same K/V


def test_reshape_and_cache_writes_only_the_slots() -> None:
    """Each token's K/V lands at its slot; every other cache element is unchanged."""
    case = make_case([(3, 5), (20, 1)], 4, 2, head_dim=64, seed=2).to(DEVICE)
    before = case.kv_cache.clone()
    reshape_and_cache(case.key, case.value, case.kv_cache, case.metadata.slot_mapping)
    flat = case.kv_cache.view(2, -1, 2, 64)
    slots = case.metadata.slot_mapping
    assert torch.equal(flat[0, slots], case.key)
    assert torch.equal(flat[1, slots], case.value)
    untouched = torch.ones(flat.shape[1], dtype=torch.bool, device=flat.device)
    untouched[slots] = False
    assert torch.equal(flat[:, untouched], before.view(2, -1, 2, 64)[:, untouched])
