"""The host probe: what this host's device and CPU compute natively (`HostCapabilities`,
`probe_host`), what `--dtype auto` means there (`auto_dtype`, a pure function of the probe:
bfloat16 only where the hardware computes it, float32 elsewhere, where torch's bf16 matmul
takes a far slower path), and the host's memory now (`host_memory`)."""

from __future__ import annotations

import logging
import platform
from dataclasses import dataclass
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

X86_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})
ARM_BF16_FLAGS = frozenset({"bf16", "sve_bf16", "svebf16"})
X86 = frozenset({"x86_64", "amd64", "i386", "i686"})
ARM = frozenset({"aarch64", "arm64"})


@dataclass(frozen=True, slots=True)
class HostCapabilities:
    """What the device computes: its kind, the CPU's architecture, torch's ISA level for its
    CPU kernels, the CPU's feature flags (torch's names), and CUDA bf16 support."""

    device: str  # "cpu" or "cuda"
    machine: str  # x86_64, aarch64, ...
    isa: str  # torch.backends.cpu.get_cpu_capability(): AVX2, AVX512, SVE256, DEFAULT, ...
    cpu_flags: frozenset[str] = frozenset()
    cuda_bf16: bool = False
    threads: int = 1

    @property
    def native_bf16(self) -> bool:
        if self.device == "cuda":
            return self.cuda_bf16
        machine = self.machine.lower()
        if machine in X86:
            return bool(self.cpu_flags & X86_BF16_FLAGS)
        if machine in ARM:
            return bool(self.cpu_flags & ARM_BF16_FLAGS)
        return False

    def report(self, dtype: torch.dtype) -> dict[str, str | int | bool]:
        """The facts the start-up log, /version and the benchmarks report."""
        return {
            "device": self.device,
            "machine": self.machine,
            "isa": self.isa,
            "native_bf16": self.native_bf16,
            "dtype": str(dtype).removeprefix("torch."),
            "threads": self.threads,
        }

    def describe(self) -> str:
        """One phrase for the start-up log: `cpu x86_64 AVX512, native bf16, 2 threads`."""
        bf16 = "native bf16" if self.native_bf16 else "no native bf16"
        if self.device == "cuda":
            return f"cuda, {bf16}"
        return f"cpu {self.machine} {self.isa}, {bf16}, {self.threads} threads"


def auto_dtype(capabilities: HostCapabilities) -> torch.dtype:
    """bfloat16 where the device computes it natively, float32 everywhere else."""
    return torch.bfloat16 if capabilities.native_bf16 else torch.float32


def probe_host(device: torch.device) -> HostCapabilities:
    """This host's capabilities, as torch reports them."""
    isa = torch.backends.cpu.get_cpu_capability()
    threads = torch.get_num_threads()
    if device.type == "cuda":
        bf16 = torch.cuda.is_bf16_supported()
        return HostCapabilities("cuda", platform.machine(), isa, cuda_bf16=bf16, threads=threads)
    flags = frozenset(name for name, value in torch.cpu.get_capabilities().items() if value is True)
    return HostCapabilities(
        device="cpu", machine=platform.machine(), isa=isa, cpu_flags=flags, threads=threads
    )


def warn_if_slow(dtype: torch.dtype, capabilities: HostCapabilities) -> None:
    """An explicit bfloat16 on a host without native bf16 runs, with a warning saying so."""
    if dtype == torch.bfloat16 and not capabilities.native_bf16:
        logger.warning(
            "--dtype bfloat16 on a host without native bf16 (%s): its matmuls take a generic "
            "path, about 100x slower than float32 on an AVX2 CPU; --dtype auto picks float32 "
            "here",
            capabilities.describe(),
        )


@dataclass(frozen=True, slots=True)
class Memory:
    """Free and total bytes of a device (or of the host)."""

    free: int
    total: int


def host_memory(meminfo: Path = Path("/proc/meminfo")) -> Memory:
    """The host's memory: available (what the kernel can hand out without swapping) and total."""
    fields = dict(line.split(":", 1) for line in meminfo.read_text().splitlines() if ":" in line)
    kib = {name: int(value.split()[0]) * 1024 for name, value in fields.items()}
    return Memory(free=kib["MemAvailable"], total=kib["MemTotal"])
