"""Prepacked oneDNN linears compute what `F.linear` does, and replace every linear layer."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from blockserve.model.packed import PackedLinear, can_prepack, prepack_linears

pytestmark = pytest.mark.skipif(
    not can_prepack("cpu"), reason="torch was built without oneDNN (mkldnn)"
)


@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.bfloat16, 0.0), (torch.float32, 1e-5)])
@pytest.mark.parametrize("bias", [False, True])
def test_a_packed_linear_equals_f_linear(dtype: torch.dtype, tolerance: float, bias: bool) -> None:
    if not can_prepack("cpu", dtype):
        pytest.skip(f"oneDNN reorders {dtype} weights only with AVX-512BW/VL/DQ or AVX-NE-CONVERT")
    torch.manual_seed(0)
    linear = nn.Linear(96, 160, bias=bias).to(dtype)
    weight = linear.weight.detach().clone()
    bias_value = None if linear.bias is None else linear.bias.detach().clone()
    packed = PackedLinear(linear)
    for shape in ((1, 96), (16, 96), (300, 96), (3, 5, 96)):
        x = torch.randn(shape).to(dtype)
        expected = F.linear(x, weight, bias_value)
        got = packed(x)
        assert got.shape == expected.shape and got.dtype == dtype
        scale = expected.float().abs().max().item()
        assert (got.float() - expected.float()).abs().max().item() <= tolerance * scale


def test_prepack_replaces_every_linear_and_keeps_the_rest() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Sequential(nn.Linear(8, 4)))
    x = torch.randn(2, 8)
    expected = model(x)
    assert prepack_linears(model) == 2
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    assert isinstance(model[1], nn.ReLU)
    torch.testing.assert_close(model(x), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    ("device", "dtype", "flags", "expected"),
    [
        ("cpu", torch.float32, frozenset({"avx2"}), True),
        ("cpu", torch.bfloat16, frozenset({"avx2", "fma3"}), False),  # AVX2-only: no reorder
        ("cpu", torch.bfloat16, frozenset({"avx2", "avx512_bw", "avx512_vl"}), False),
        ("cpu", torch.bfloat16, frozenset({"avx512_bw", "avx512_vl", "avx512_dq"}), True),
        ("cpu", torch.bfloat16, frozenset({"avx2", "avx_ne_convert"}), True),
        ("cpu", torch.float16, frozenset({"avx512_bw", "avx512_vl", "avx512_dq"}), False),
        ("cuda", torch.float32, frozenset({"avx512_bw", "avx512_vl", "avx512_dq"}), False),
    ],
)
def test_prepacking_is_chosen_by_device_dtype_and_cpu_features(
    device: str, dtype: torch.dtype, flags: frozenset[str], expected: bool
) -> None:
    assert can_prepack(device, dtype, flags) is expected
