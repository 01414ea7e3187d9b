"""The cuda attention backend: csrc/ kernels for writing K/V and for decode attention. Prefill
queries go through torch's fused attention on the device (the same code as the torch backend);
decodes through csrc's paged decode kernel. The extension is built on first use, only where CUDA
and a compiler exist; a CPU-only install never builds or needs it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from blockserve.attention.batch_split import all_prefill_plans, split_batch
from blockserve.attention.metadata import AttentionMetadata
from blockserve.attention.prefill import PrefillPlan, attend_prefills
from blockserve.errors import BackendUnavailableError
from blockserve.kernels.sources import source_dir

CSRC = source_dir("cuda")


def load_extension() -> Any:
    """Build (or load the cached build of) csrc/ as a torch extension."""
    if not torch.cuda.is_available():
        raise BackendUnavailableError("the cuda attention backend needs a CUDA device; none found")
    if not (CSRC / "kernels.cu").is_file():
        raise BackendUnavailableError(f"the cuda backend's sources are missing from {CSRC}")
    from torch.utils.cpp_extension import load

    return load(
        name="blockserve_cuda",
        sources=[str(CSRC / "bindings.cpp"), str(CSRC / "kernels.cu")],
        extra_include_paths=[str(CSRC)],
        extra_cuda_cflags=["-O3"],
        verbose=False,
    )


@dataclass(frozen=True, slots=True)
class CudaAttentionPlan:
    slot_mapping: torch.Tensor
    decode_token_indices: torch.Tensor | None  # [num_decodes]
    decode_block_tables: torch.Tensor | None  # [num_decodes, max_blocks] int64, contiguous
    decode_seq_lens: torch.Tensor | None  # [num_decodes] int64
    max_decode_len: int  # the longest decode context (sizes the kernel's KV splits)
    prefills: tuple[PrefillPlan, ...]


class CudaAttentionBackend:
    name = "cuda"

    def __init__(self, ops: Any = None) -> None:
        """`ops`: the compiled extension (built here when None); tests pass csrc run on the CPU
        (tests/attention/cuda_emulation) behind the same two calls."""
        self.ops = ops if ops is not None else load_extension()

    def forget_kv(self) -> None:
        """Nothing is kept between steps."""

    def prepare(self, metadata: AttentionMetadata) -> CudaAttentionPlan:
        split = split_batch(metadata)
        decode_rows, decode_tokens = split.decode_rows, split.decode_tokens
        prefills = all_prefill_plans(metadata, split)
        if not decode_rows:
            return CudaAttentionPlan(
                slot_mapping=metadata.slot_mapping,
                decode_token_indices=None,
                decode_block_tables=None,
                decode_seq_lens=None,
                max_decode_len=0,
                prefills=prefills,
            )
        device = metadata.slot_mapping.device
        rows = torch.tensor(decode_rows, device=device)
        return CudaAttentionPlan(
            slot_mapping=metadata.slot_mapping,
            decode_token_indices=torch.tensor(decode_tokens, device=device),
            decode_block_tables=metadata.block_tables[rows].contiguous(),
            decode_seq_lens=metadata.seq_lens[rows].contiguous(),
            max_decode_len=max(metadata.seq_lens_cpu[r] for r in decode_rows),
            prefills=prefills,
        )

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        plan: CudaAttentionPlan,
    ) -> torch.Tensor:
        self.ops.reshape_and_cache(
            key.contiguous(), value.contiguous(), kv_cache[0], kv_cache[1], plan.slot_mapping
        )
        output = torch.empty_like(query)
        if plan.decode_token_indices is not None:
            decode_out = torch.empty_like(query[plan.decode_token_indices])
            self.ops.paged_decode(
                decode_out,
                query[plan.decode_token_indices].contiguous(),
                kv_cache[0],
                kv_cache[1],
                plan.decode_block_tables,
                plan.decode_seq_lens,
                plan.max_decode_len,
            )
            output[plan.decode_token_indices] = decode_out
        attend_prefills(query, key, value, kv_cache, plan.prefills, output)
        return output
