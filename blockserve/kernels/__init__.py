"""Our CPU kernels (csrc/cpu), built with the host's g++ at run time and loaded into torch as
operators: `build` makes a library, `KernelLoader` loads it, `CpuKernels` hands out its
operators; on CUDA, `triton_layer_ops.GpuKernels` hands out Triton ones. Below `attention/`
and `model/`, which use them, and importing neither.

Modules:

  sources.py           where csrc/ is: a checkout's, or the copy a wheel carries
  build.py             the libraries (bf16, f32) and their builds (f32: AVX2, AVX-512F):
                       sources, flags, host needs, the g++ build into the cache dir
  loader.py            KernelLoader: builds (on a thread) and loads a library into torch, once a
                       process; what waits for it
  cpu.py               CpuKernels: the typed operator table and its switches, one per runner
  triton_layer_ops.py  on CUDA: RMSNorm (+ residual add), rotary, SiLU-mul as Triton kernels
  triton_compiles.py   counts Triton's compilations (its hook): none after ready
  triton_lora.py       on CUDA: LoRA's grouped shrink and expand, fused, one launch a projection
"""

from __future__ import annotations

from blockserve.kernels.cpu import CpuKernels, KernelSwitches, LayerOpsSource, fits_model
from blockserve.kernels.loader import KernelLoader

__all__ = ["CpuKernels", "KernelLoader", "KernelSwitches", "LayerOpsSource", "fits_model"]
