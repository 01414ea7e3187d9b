"""Without a CUDA device, Triton kernels run under its interpreter (set before they are
imported: `triton.jit` reads it when decorating)."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
