"""`--dtype auto` per host kind: bfloat16 only where the device computes it natively."""

from __future__ import annotations

import logging

import pytest
import torch

from blockserve.model.loader import resolve_dtype
from blockserve.platform import HostCapabilities, auto_dtype, probe_host, warn_if_slow

AVX2 = frozenset({"avx", "avx2", "fma3"})
AVX512 = AVX2 | {"avx512_f", "avx512_bw", "avx512_vnni"}

HOSTS = {
    "cuda with bf16 (Ampere and later)": (
        HostCapabilities("cuda", "x86_64", "AVX2", cuda_bf16=True),
        torch.bfloat16,
    ),
    "cuda without bf16 (Turing)": (HostCapabilities("cuda", "x86_64", "AVX2"), torch.float32),
    "x86 AVX2 only": (HostCapabilities("cpu", "x86_64", "AVX2", AVX2), torch.float32),
    "x86 AVX-512 without BF16": (
        HostCapabilities("cpu", "x86_64", "AVX512", AVX512),
        torch.float32,
    ),
    "x86 AVX512-BF16": (
        HostCapabilities("cpu", "x86_64", "AVX512", AVX512 | {"avx512_bf16"}),
        torch.bfloat16,
    ),
    "x86 AMX-BF16": (
        HostCapabilities("cpu", "x86_64", "AVX512", AVX512 | {"amx_bf16"}),
        torch.bfloat16,
    ),
    "Arm with BF16": (
        HostCapabilities("cpu", "aarch64", "SVE256", frozenset({"sve", "bf16"})),
        torch.bfloat16,
    ),
    "Arm without BF16": (
        HostCapabilities("cpu", "aarch64", "DEFAULT", frozenset({"asimd"})),
        torch.float32,
    ),
    "another architecture": (
        HostCapabilities("cpu", "riscv64", "DEFAULT", frozenset({"bf16"})),
        torch.float32,
    ),
}


@pytest.mark.parametrize("host", sorted(HOSTS))
def test_auto_is_bfloat16_only_where_it_is_native(host: str) -> None:
    capabilities, expected = HOSTS[host]
    assert auto_dtype(capabilities) == expected
    assert resolve_dtype("auto", capabilities) == expected
    assert resolve_dtype("float32", capabilities) == torch.float32  # an explicit choice stands
    assert resolve_dtype("bfloat16", capabilities) == torch.bfloat16


def test_this_host_is_probed_from_torch() -> None:
    """The probe agrees with torch's own capability report for this CPU."""
    host = probe_host(torch.device("cpu"))
    native = bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
    assert (host.device, host.isa) == ("cpu", torch.backends.cpu.get_cpu_capability())
    assert host.threads == torch.get_num_threads()
    if host.machine == "x86_64":
        assert host.native_bf16 == native


def test_bfloat16_without_native_support_warns(caplog: pytest.LogCaptureFixture) -> None:
    slow = HOSTS["x86 AVX2 only"][0]
    fast = HOSTS["x86 AVX512-BF16"][0]
    with caplog.at_level(logging.WARNING, "blockserve.platform"):
        warn_if_slow(torch.bfloat16, fast)
        warn_if_slow(torch.float32, slow)
        assert caplog.records == []
        warn_if_slow(torch.bfloat16, slow)
    (record,) = caplog.records
    assert "100x slower" in record.getMessage() and "cpu x86_64 AVX2" in record.getMessage()


def test_the_report_names_device_isa_dtype_and_threads() -> None:
    host = HostCapabilities("cpu", "x86_64", "AVX2", AVX2, threads=2)
    assert host.report(torch.float32) == {
        "device": "cpu",
        "machine": "x86_64",
        "isa": "AVX2",
        "native_bf16": False,
        "dtype": "float32",
        "threads": 2,
    }
    assert host.describe() == "cpu x86_64 AVX2, no native bf16, 2 threads"
