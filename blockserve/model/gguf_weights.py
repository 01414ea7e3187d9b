"""`--quantization gguf`: a Llama GGUF file's quantized blocks for the model's fused linear
layers, as the file stores them (csrc/cpu/linear_gguf.cpp reads them)."""

from __future__ import annotations

import logging
import mmap
from pathlib import Path

import numpy as np
import torch
from torch import nn

from blockserve.errors import InvalidConfigError
from blockserve.model.arch import LlamaArchConfig
from blockserve.model.gguf_llama import TensorInfo, read_header, unpermute
from blockserve.model.packed import PackedLinear

logger = logging.getLogger(__name__)

# GGML's numbers for the types our kernel reads, and their blocks: (weights, bytes).
BLOCKS = {2: (32, 18), 3: (32, 20), 8: (32, 34)}  # Q4_0, Q4_1, Q8_0
COLUMN_GROUP = 16  # the kernel takes output features 16 at a time

# Each fused layer of ours and the GGUF tensors it is made of, in order.
_LAYER_PARTS = {
    "self_attn.qkv_proj": ("attn_q", "attn_k", "attn_v"),
    "self_attn.o_proj": ("attn_output",),
    "mlp.gate_up_proj": ("ffn_gate", "ffn_up"),
    "mlp.down_proj": ("ffn_down",),
}


def quantized_linears(path: Path, arch: LlamaArchConfig) -> dict[str, tuple[int, torch.Tensor]]:
    """For each linear layer of the model (by module name) whose GGUF tensors share one type
    our kernel reads: that type and the blocks, uint8 [out_features, bytes per row], q and k
    rows put back in Hugging Face's order as the dequantized weights are. Other layers are
    left out (they run on the dequantized weights). InvalidConfigError for a file of another
    architecture than Llama."""
    with path.open("rb") as file:
        meta, infos, start, buffer = read_header(file)
        try:
            if meta.get("general.architecture") != "llama":
                # Other architectures' q/k rows are ordered otherwise in the file.
                raise InvalidConfigError(
                    f"--quantization gguf serves Llama GGUF files; {path.name} is "
                    f"{meta.get('general.architecture')!r}"
                )
            wanted = {
                f"model.layers.{i}.{name}": tuple(f"blk.{i}.{part}.weight" for part in parts)
                for i in range(arch.num_layers)
                for name, parts in _LAYER_PARTS.items()
            }
            by_name = {info.name: info for info in infos}
            # Tied embeddings: the LM head is the token embedding's matrix.
            head = "output.weight" if "output.weight" in by_name else "token_embd.weight"
            wanted["lm_head"] = (head,)
            heads = meta["llama.attention.head_count"]
            kv_heads = meta.get("llama.attention.head_count_kv", heads)
            found = {}
            for module, names in wanted.items():
                parts = [by_name.get(name) for name in names]
                if any(p is None for p in parts):
                    continue
                types = {p.qtype for p in parts if p is not None}
                if len(types) != 1 or (qtype := types.pop()) not in BLOCKS:
                    continue
                rows = [_rows(buffer, start, p, heads, kv_heads) for p in parts if p is not None]
                blocks = np.concatenate(rows)
                if blocks.shape[0] % COLUMN_GROUP == 0:
                    found[module] = (qtype, torch.from_numpy(blocks))
        finally:
            buffer.close()
    logger.info(
        "%d of %d linear layers serve %s's quantized blocks", len(found), len(wanted), path.name
    )
    return found


def _rows(buffer: mmap.mmap, start: int, info: TensorInfo, heads: int, kv_heads: int) -> np.ndarray:
    """A tensor's blocks, one row per output feature, copied out of the mapped file."""
    weights, size = BLOCKS[info.qtype]
    in_features, out_features = info.dims[0], int(np.prod(info.dims[1:]))
    row_bytes = in_features // weights * size
    raw = np.frombuffer(buffer, np.uint8, out_features * row_bytes, start + info.offset)
    rows = raw.reshape(out_features, row_bytes)
    if info.name.endswith("attn_q.weight"):
        rows = unpermute(rows, heads)
    elif info.name.endswith("attn_k.weight"):
        rows = unpermute(rows, kv_heads)
    return np.array(rows)  # a copy: the map closes


def attach(model: nn.Module, blocks: dict[str, tuple[int, torch.Tensor]]) -> int:
    """Hand each `PackedLinear` named in `blocks` its GGUF blocks (packed for the kernel once
    it loads: weight_copies.pack_for_gguf); returns how many took them."""
    modules = dict(model.named_modules())
    taken = 0
    for name, (qtype, rows) in blocks.items():
        linear = modules.get(name)
        if isinstance(linear, PackedLinear) and rows.shape[0] == linear.out_features:
            linear.gguf, linear.gguf_type = rows, qtype
            taken += 1
    return taken
