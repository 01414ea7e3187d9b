"""csrc/cuda/kernels.cu on the CPU: build the emulator library (emulate.cpp, which includes the
kernels) with g++ and load it with ctypes. See emulate.h for what emulation does and does not
check."""

from __future__ import annotations

import ctypes
import math
import shutil
import subprocess
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
CSRC = HERE.parents[2] / "csrc" / "cuda"


def cuda_include_dir() -> Path | None:
    """The CUDA headers' folder (types and fp16/bf16 conversions; no CUDA runtime is linked)."""
    from torch.utils.cpp_extension import CUDA_HOME

    include = Path(CUDA_HOME or "/usr/local/cuda") / "include"
    return include if (include / "cuda_runtime_api.h").is_file() else None


def missing_tools() -> str | None:
    """Why the emulator cannot be built here, or None."""
    if shutil.which("g++") is None:
        return "g++ is not installed on this machine"
    if cuda_include_dir() is None:
        return "the CUDA headers are not installed on this machine"
    return None


def build_emulator(out_dir: Path) -> ctypes.CDLL:
    library = out_dir / "libblockserve_emulated.so"
    command = [
        "g++",
        "-std=c++20",
        "-O2",
        "-shared",
        "-fPIC",
        "-DBLOCKSERVE_CPU_EMULATION",
        f"-I{cuda_include_dir()}",
        f"-I{CSRC}",
        f"-I{HERE}",
        str(HERE / "emulate.cpp"),
        "-o",
        str(library),
    ]
    subprocess.run(command, check=True, capture_output=True, text=True, timeout=300)
    lib = ctypes.CDLL(str(library))
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.emulated_reshape_and_cache.argtypes = [
        ctypes.c_int,
        *[ptr] * 5,
        i64,
        i64,
        i64,
        ctypes.c_int,
    ]
    lib.emulated_paged_decode.argtypes = [
        ctypes.c_int,
        *[ptr] * 6,
        *[ctypes.c_int] * 6,
        i64,
        i64,
        ctypes.c_float,
        ctypes.c_int,
    ]
    lib.emulated_decode_splits.argtypes = [*[ctypes.c_int] * 3, i64, ctypes.c_int]
    return lib


DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
H100_MULTIPROCESSORS = 132


class EmulatedOps:
    """The extension's two calls as csrc/cuda/bindings.cpp makes them, on CPU tensors through the
    emulator: a drop-in `ops` for CudaAttentionBackend. Splits are chosen for an H100/H200's
    132 multiprocessors, as the bindings would there. `decode` is the launcher itself, with the
    split count given and its error code returned, for tests of the kernel."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib

    def reshape_and_cache(
        self,
        key: torch.Tensor,  # [num_tokens, kv_heads, head_dim]
        value: torch.Tensor,
        key_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
        value_cache: torch.Tensor,
        slot_mapping: torch.Tensor,  # [num_tokens] int64
    ) -> None:
        code = self.lib.emulated_reshape_and_cache(
            DTYPE_CODES[key.dtype],
            key.data_ptr(),
            value.data_ptr(),
            key_cache.data_ptr(),
            value_cache.data_ptr(),
            slot_mapping.contiguous().data_ptr(),
            key.shape[0],
            key.stride(0),
            value.stride(0),
            key.shape[1] * key.shape[2],
        )
        if code != 0:
            raise RuntimeError(f"reshape_and_cache failed: {code}")

    def paged_decode(
        self,
        out: torch.Tensor,  # [num_seqs, heads, head_dim]
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        block_tables: torch.Tensor,  # [num_seqs, max_blocks] int64
        seq_lens: torch.Tensor,  # [num_seqs] int64
        max_seq_len: int,
    ) -> None:
        num_seqs, num_heads, _ = query.shape
        num_kv_heads = key_cache.shape[2]
        splits = self.lib.emulated_decode_splits(
            num_seqs, num_kv_heads, num_heads // num_kv_heads, max_seq_len, H100_MULTIPROCESSORS
        )
        code = self.decode(out, query, key_cache, value_cache, block_tables, seq_lens, splits)
        if code != 0:
            raise RuntimeError(f"paged_decode failed: {code}")

    def decode(
        self,
        out: torch.Tensor,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        num_splits: int,
    ) -> int:
        """paged_decode's launcher with `num_splits`: 0, a cudaError_t, or -1 (deadlock)."""
        num_seqs, num_heads, head_dim = query.shape
        num_kv_heads = key_cache.shape[2]
        tables, lens = block_tables.contiguous(), seq_lens.contiguous()
        return int(
            self.lib.emulated_paged_decode(
                DTYPE_CODES[query.dtype],
                out.data_ptr(),
                query.data_ptr(),
                key_cache.data_ptr(),
                value_cache.data_ptr(),
                tables.data_ptr(),
                lens.data_ptr(),
                num_seqs,
                num_kv_heads,
                num_heads // num_kv_heads,
                head_dim,
                key_cache.shape[1],
                tables.shape[1],
                query.stride(0),
                out.stride(0),
                1 / math.sqrt(head_dim),
                num_splits,
            )
        )
