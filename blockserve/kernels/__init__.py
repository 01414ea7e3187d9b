"""Our CPU kernels (csrc/cpu), built with the host's g++ at run time and loaded into torch as
operators: `build` makes a library, `KernelLoader` loads it, `CpuKernels` hands out its
operators; on CUDA, `triton_layer_ops.GpuKernels` hands out Triton ones. Below `attention/`
and `model/`, which use them, and importing neither."""

from __future__ import annotations

from blockserve.kernels.cpu import CpuKernels, KernelSwitches, LayerOpsSource, fits_model
from blockserve.kernels.loader import KernelLoader

__all__ = ["CpuKernels", "KernelLoader", "KernelSwitches", "LayerOpsSource", "fits_model"]
