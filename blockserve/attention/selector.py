"""Choosing an attention backend: automatic by device, or by name with a clear error."""

from __future__ import annotations

import os

from blockserve.attention.metadata import AttentionBackend
from blockserve.attention.torch_backend import TorchAttentionBackend
from blockserve.config import ATTENTION_BACKENDS
from blockserve.errors import BackendUnavailableError, InvalidConfigError
from blockserve.kernels import CpuKernels


def get_attention_backend(
    name: str, device: str, kernels: CpuKernels | None = None
) -> AttentionBackend:
    """`auto`: triton on a CUDA device, torch on the CPU (with our `kernels` where loaded). A
    named backend that cannot run here raises BackendUnavailableError saying why."""
    if name not in ATTENTION_BACKENDS:
        raise InvalidConfigError(
            f"unknown attention backend {name!r}; choose one of {', '.join(ATTENTION_BACKENDS)}"
        )
    on_cuda = device.startswith("cuda")
    if name == "auto":
        name = "triton" if on_cuda else "torch"
    if name == "torch":
        return TorchAttentionBackend(kernels=kernels)
    if name == "triton":
        if not on_cuda and os.environ.get("TRITON_INTERPRET") != "1":
            raise BackendUnavailableError(
                "the triton attention backend needs a CUDA device (on the CPU its kernels run "
                "only under TRITON_INTERPRET=1, for tests)"
            )
        from blockserve.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend()
    if not on_cuda:
        raise BackendUnavailableError(
            f"the cuda attention backend needs a CUDA device, not {device}"
        )
    from blockserve.attention.cuda_backend import CudaAttentionBackend

    return CudaAttentionBackend()
