"""The cuda attention backend's Python glue, with the csrc kernels run on the CPU by the fiber
emulator standing in for the extension: a mixed batch equals the torch backend."""

from __future__ import annotations

import ctypes

import pytest
import torch

from blockserve.attention.cuda_backend import CudaAttentionBackend
from blockserve.attention.torch_backend import TorchAttentionBackend
from tests.attention.cases import make_case, reference_attention
from tests.attention.cuda_emulation import EmulatedOps, missing_tools
from tests.attention.test_csrc_emulated import TOLERANCE

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(missing_tools() is not None, reason=str(missing_tools())),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_backend_matches_torch_backend(emulator: ctypes.CDLL, dtype: torch.dtype) -> None:
    """blockserve's cuda backend, with the csrc kernels run on the CPU: a batch of fresh and
    prefix prefills (torch attention) and decodes of 1 to 300 tokens (paged_decode, split
    for 132 multiprocessors) gives the torch backend's output and writes the same K/V."""
    specs = [(0, 23), (37, 1), (16, 9), (299, 1), (5, 30), (0, 1)]
    case = make_case(specs, 6, 2, 64, dtype=dtype, seed=11)
    torch_cache = case.kv_cache.clone()
    backend = CudaAttentionBackend(ops=EmulatedOps(emulator))
    out = backend.forward(
        case.query, case.key, case.value, case.kv_cache, backend.prepare(case.metadata)
    )
    torch_backend = TorchAttentionBackend()
    expected = torch_backend.forward(
        case.query, case.key, case.value, torch_cache, torch_backend.prepare(case.metadata)
    )
    assert torch.equal(case.kv_cache, torch_cache)
    assert (out.float() - expected.float()).abs().max().item() < 2 * TOLERANCE[dtype]
    assert (out.double() - reference_attention(case)).abs().max().item() < TOLERANCE[dtype]
