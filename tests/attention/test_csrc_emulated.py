"""csrc/cuda/kernels.cu run on the CPU through the fiber emulator (tests/attention/cuda_emulation):
the paged decode kernel equals the float64 reference and the torch backend for every head_dim
it supports (16, 64, 128), GQA groups of 1 to 10 query heads, contexts that leave warps idle or
end mid-step, unsplit and split (with empty splits), in float32, float16 and bfloat16;
reshape_and_cache writes exactly the slots. (test_cuda_backend.py runs the backend over them.)"""

from __future__ import annotations

import ctypes

import pytest
import torch

from blockserve.attention.torch_backend import TorchAttentionBackend
from tests.attention.cases import AttentionCase, make_case, reference_attention
from tests.attention.cuda_emulation import EmulatedOps, missing_tools

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(missing_tools() is not None, reason=str(missing_tools())),
]

TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
# Contexts of 1 (only warp 0 has work), 7 / 9 (a step cut short), 8, 37, 200 tokens.
CONTEXTS = [(0, 1), (6, 1), (8, 1), (7, 1), (36, 1), (199, 1)]


def paged_decode(
    lib: ctypes.CDLL, case: AttentionCase, num_splits: int = 1
) -> tuple[int, torch.Tensor]:
    """The decode kernel over `case` (K/V already in its cache): its code and its output,
    poisoned beforehand so that unwritten elements fail."""
    out = torch.full_like(case.query, float("nan"))
    cache, metadata = case.kv_cache, case.metadata
    code = EmulatedOps(lib).decode(
        out, case.query, cache[0], cache[1], metadata.block_tables, metadata.seq_lens, num_splits
    )
    return code, out


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim"),
    [(4, 2, 16), (6, 2, 64), (8, 2, 128), (12, 2, 64), (10, 1, 64), (2, 2, 64)],
)
def test_paged_decode_matches_reference(
    emulator: ctypes.CDLL,
    dtype: torch.dtype,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    num_splits: int,
) -> None:
    """Groups of 2, 3, 4, 6 (one 8-head block, two idle), 10 (8 + 2 heads in two blocks) and 1
    query heads per KV head; head_dim 16 leaves half the lanes idle; split in three, the
    1-token context leaves two splits empty."""
    case = make_case(CONTEXTS, num_heads, num_kv_heads, head_dim, dtype=dtype, seed=5)
    torch_backend = TorchAttentionBackend()
    expected = torch_backend.forward(  # also writes the new K/V into the case's cache
        case.query, case.key, case.value, case.kv_cache, torch_backend.prepare(case.metadata)
    )
    code, out = paged_decode(emulator, case, num_splits)
    assert code == 0
    assert not torch.isnan(out).any()
    reference = reference_attention(case)
    assert (out.double() - reference).abs().max().item() < TOLERANCE[dtype]
    assert (out.float() - expected.float()).abs().max().item() < 2 * TOLERANCE[dtype]


def test_many_splits_of_a_long_context(emulator: ctypes.CDLL) -> None:
    """A 1,000-token context cut into 32 splits of 4 steps (most of them shared by 4 warps)
    plus a 5-token one whose 31 last splits are empty: equal to the reference."""
    case = make_case([(999, 1), (4, 1)], 8, 2, 128, dtype=torch.float16, seed=9)
    EmulatedOps(emulator).reshape_and_cache(
        case.key, case.value, case.kv_cache[0], case.kv_cache[1], case.metadata.slot_mapping
    )
    code, out = paged_decode(emulator, case, num_splits=32)
    assert code == 0
    assert (out.double() - reference_attention(case)).abs().max().item() < TOLERANCE[torch.float16]


def test_split_count_fills_the_device(emulator: ctypes.CDLL) -> None:
    """On 132 multiprocessors (H100/H200): one 8k decode over 8 KV heads splits 32 ways (the
    cap); 64 of them need no split; 16 split in three (two blocks per SM); a 300-token context
    splits at most 4 ways (two 8-key steps per warp each), a 100-token one not at all; GQA 10:1
    takes two blocks per KV head."""
    splits = emulator.emulated_decode_splits
    assert splits(1, 8, 4, 8193, 132) == 32
    assert splits(64, 8, 4, 8193, 132) == 1
    assert splits(16, 8, 4, 8193, 132) == 3
    assert splits(1, 8, 4, 300, 132) == 4
    assert splits(1, 8, 4, 100, 132) == 1
    assert splits(8, 1, 10, 8193, 132) == 17  # 8 x 2 blocks: ceil(264 / 16)


def test_paged_decode_refuses_an_unsupported_head_dim(emulator: ctypes.CDLL) -> None:
    """head_dim 96 is not one the kernel is built for: cudaErrorInvalidValue (1), no write."""
    case = make_case([(10, 1)], 2, 1, 96, seed=1)
    code, out = paged_decode(emulator, case)
    assert code == 1
    assert torch.isnan(out).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reshape_and_cache_writes_only_the_slots(emulator: ctypes.CDLL, dtype: torch.dtype) -> None:
    """Each token's K/V row lands at its slot; every other cache element is unchanged."""
    case = make_case([(3, 5), (20, 1)], 4, 2, head_dim=64, dtype=dtype, seed=2)
    before = case.kv_cache.clone()
    slots = case.metadata.slot_mapping
    EmulatedOps(emulator).reshape_and_cache(
        case.key, case.value, case.kv_cache[0], case.kv_cache[1], slots
    )
    flat = case.kv_cache.view(2, -1, 2, 64)
    assert torch.equal(flat[0, slots], case.key)
    assert torch.equal(flat[1, slots], case.value)
    untouched = torch.ones(flat.shape[1], dtype=torch.bool)
    untouched[slots] = False
    assert torch.equal(flat[:, untouched], before.view(2, -1, 2, 64)[:, untouched])
