"""Shared-prefix attention: decodes and prefill chunks over common cached blocks read them
once (cascade), and equal dense attention."""

from __future__ import annotations

import pytest
import torch

from blockserve.attention.shared_prefix import merge, num_common_blocks
from blockserve.attention.torch_backend import TorchAttentionBackend
from blockserve.kernels import CpuKernels
from blockserve.kernels.build import can_build
from tests.attention.cases import make_case, reference_attention
from tests.attention.test_torch_backend import TOLERANCE


def test_common_blocks_are_the_equal_leading_columns_within_the_cap() -> None:
    """Rows agree on blocks 0-1, differ at 2; the token cap can shorten that further."""
    tables = torch.tensor([[4, 5, 6, 7], [4, 5, 9, 7], [4, 5, 6, 1]])
    assert num_common_blocks(tables, 64, 16) == 2
    assert num_common_blocks(tables, 31, 16) == 1
    assert num_common_blocks(tables[:1], 64, 16) == 0  # one row shares with nobody


def test_merging_two_partial_softmaxes_equals_one_softmax() -> None:
    """Attention over keys A then B, merged by log-sum-exp, equals attention over A and B."""
    generator = torch.Generator().manual_seed(0)
    scores = torch.randn(3, 10, generator=generator, dtype=torch.float64)
    values = torch.randn(10, 4, generator=generator, dtype=torch.float64)

    def attend(columns: slice) -> tuple[torch.Tensor, torch.Tensor]:
        part = scores[:, columns]
        return torch.softmax(part, -1) @ values[columns], torch.logsumexp(part, -1)

    merged = merge(*attend(slice(0, 6)), *attend(slice(6, 10)))
    assert torch.allclose(merged, torch.softmax(scores, -1) @ values, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decodes_sharing_prefix_blocks_read_them_once(dtype: torch.dtype) -> None:
    """Decodes over 4 common blocks use the shared-prefix path when it saves enough key reads
    (here (5 − 1) × 4 blocks), and equal dense attention either way."""
    specs = [(64, 1), (64, 1), (70, 1), (99, 1), (65, 1)]
    case = make_case(specs, 6, 2, head_dim=64, dtype=dtype, shared_blocks=4, seed=3)
    saved = (len(specs) - 1) * 4 * case.metadata.block_size
    below = TorchAttentionBackend(min_shared_decode_tokens=saved + 1)
    per_sequence = below.prepare(case.metadata)
    assert per_sequence.decode is not None and per_sequence.decode.common_block_ids is None
    out = below.forward(case.query, case.key, case.value, case.kv_cache, per_sequence)
    assert (out.double() - reference_attention(case)).abs().max().item() < TOLERANCE[dtype]

    backend = TorchAttentionBackend(min_shared_decode_tokens=saved)
    plan = backend.prepare(case.metadata)
    assert plan.decode is not None and plan.decode.common_block_ids is not None
    assert plan.decode.common_block_ids.tolist() == case.metadata.block_tables[0, :4].tolist()
    out = backend.forward(case.query, case.key, case.value, case.kv_cache, plan)
    assert (out.double() - reference_attention(case)).abs().max().item() < TOLERANCE[dtype]


# (cached, new) tokens of each sequence; where the shared-prefix rows' queries start
CHUNKS = {
    # chunks of 32, 5 and 17 tokens (then a fresh prefill, a decode): gathered, with padding
    "uneven": ([(48, 32), (50, 5), (70, 17), (0, 20), (60, 1)], None),
    # three chunks of 16, one run of the batch after a decode: read where they lie
    "one run": ([(60, 1), (48, 16), (50, 16), (70, 16), (0, 20)], 1),
}


@pytest.mark.parametrize("chunks", CHUNKS)
@pytest.mark.parametrize("kernels", [pytest.param("ours", marks=pytest.mark.slow), "torch's"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_chunks_on_a_shared_prefix_read_it_once(
    dtype: torch.dtype, kernels: str, chunks: str, request: pytest.FixtureRequest
) -> None:
    """Chunks on 3 shared blocks use the shared-prefix path, exactly: with our kernels where
    the host has them (each chunk's own keys continue from the common blocks' softmax) and
    with torch's (the two softmaxes merged); chunks of one length that are one run of the
    batch are read and written in place, others gathered. Only our kernels' variants build
    the CPU kernel libraries (the fixture, hence slow), so torch's run on a GPU machine in
    seconds."""
    specs, first_token = CHUNKS[chunks]
    ours = kernels == "ours" and can_build(dtype)
    table = CpuKernels()
    if ours:
        assert table.loader.load(request.getfixturevalue("cpu_kernels_dir"), dtype) is not None
    assert (table.dense_attention(torch.zeros(1, 64, dtype=dtype)) is not None) == ours
    case = make_case(specs, 6, 2, head_dim=64, dtype=dtype, shared_blocks=3, seed=9)
    backend = TorchAttentionBackend(kernels=table)
    plan = backend.prepare(case.metadata)
    assert plan.shared_prefix is not None
    chunks_on_it = [row for row, (cached, n) in enumerate(specs) if cached and n > 1]
    assert plan.shared_prefix.common_block_ids.tolist() == (
        case.metadata.block_tables[chunks_on_it[0], :3].tolist()
    )
    shared = [specs[row][1] for row in chunks_on_it]
    assert plan.shared_prefix.valid.sum().item() == sum(shared)
    assert plan.shared_prefix.first_token == first_token
    assert len(plan.prefills) == 1  # only the fresh prefill goes one by one
    out = backend.forward(case.query, case.key, case.value, case.kv_cache, plan)
    assert (out.double() - reference_attention(case)).abs().max().item() < TOLERANCE[dtype]
