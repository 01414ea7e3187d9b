"""A Llama GGUF file into a Hugging Face directory's config.json and model.safetensors, fast."""

from __future__ import annotations

import json
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch
from safetensors.torch import save_file

from blockserve.errors import ModelNotFoundError

# transformers converts a GGUF file by parsing it three times (config, weights, tokenizer), each
# parse reading the 49,152-entry vocabulary of the default model element by element through numpy
# (seconds each on 2 vCPUs). Here the header is read once with `struct` and the weights are
# dequantized by the `gguf` package; the tokenizer is still transformers' conversion. Only plain
# Llama files take this path (no RoPE scaling, no tensor it cannot name); anything else returns
# False and is left to transformers. The result equals transformers' tensor for tensor
# (tests/model/test_gguf_llama.py).

# GGUF value types: 0 u8, 1 i8, 2 u16, 3 i16, 4 u32, 5 i32, 6 f32, 7 bool, 8 string, 9 array,
# 10 u64, 11 i64, 12 f64.
_SCALARS = dict(zip((0, 1, 2, 3, 4, 5, 6, 7, 10, 11, 12), "BbHhIif?Qqd", strict=True))
_STRING, _ARRAY = 8, 9
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dims: tuple[int, ...]  # GGUF order: dims[0] varies fastest
    qtype: int
    offset: int  # from the start of the data section


class _Reader:
    def __init__(self, buffer: mmap.mmap) -> None:
        self.buffer, self.at = buffer, 0

    def scalar(self, fmt: str) -> Any:
        (value,) = struct.unpack_from("<" + fmt, self.buffer, self.at)
        self.at += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        length = self.scalar("Q")
        text = bytes(self.buffer[self.at : self.at + length]).decode("utf-8", errors="replace")
        self.at += length
        return text

    def value(self, kind: int) -> Any:
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item_kind, count = self.scalar("I"), self.scalar("Q")
            return [self.value(item_kind) for _ in range(count)]
        return self.scalar(_SCALARS[kind])


def read_header(file: BinaryIO) -> tuple[dict[str, Any], list[TensorInfo], int, mmap.mmap]:
    """Metadata, tensor infos, the data section's offset, and the mapped file (the caller
    closes it). ModelNotFoundError for a file that is not a readable GGUF file."""
    buffer = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        return (*_parse(buffer), buffer)
    except (ValueError, KeyError, struct.error) as exc:
        buffer.close()
        raise ModelNotFoundError(f"{file.name} is not a readable GGUF file ({exc})") from None


def _parse(buffer: mmap.mmap) -> tuple[dict[str, Any], list[TensorInfo], int]:
    reader = _Reader(buffer)
    if bytes(buffer[:4]) != b"GGUF":
        raise ValueError("no GGUF magic")
    reader.at = 4
    version, tensor_count, kv_count = reader.scalar("I"), reader.scalar("Q"), reader.scalar("Q")
    if version < 2:
        raise ValueError(f"GGUF version {version} is not supported")
    metadata = {}
    for _ in range(kv_count):
        key = reader.string()
        metadata[key] = reader.value(reader.scalar("I"))
    tensors = []
    for _ in range(tensor_count):
        name = reader.string()
        dims = tuple(reader.scalar("Q") for _ in range(reader.scalar("I")))
        tensors.append(
            TensorInfo(name=name, dims=dims, qtype=reader.scalar("I"), offset=reader.scalar("Q"))
        )
    alignment = metadata.get("general.alignment", 32)
    return metadata, tensors, -(-reader.at // alignment) * alignment


def _hf_name(gguf_name: str) -> str | None:
    """The Hugging Face name of a GGUF tensor; None for one this converter does not know."""
    stem, _, kind = gguf_name.rpartition(".")
    parts = stem.split(".")
    if parts[0] == "blk" and len(parts) == 3 and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{kind}"
    return f"{_GLOBAL_NAMES[stem]}.{kind}" if stem in _GLOBAL_NAMES else None


def unpermute(weight: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's reordering of q/k rows (it interleaves each head's two RoPE halves)."""
    half = weight.shape[0] // heads // 2
    return weight.reshape(heads, half, 2, *weight.shape[1:]).swapaxes(2, 1).reshape(weight.shape)


def _tensor(buffer: mmap.mmap, start: int, info: TensorInfo) -> np.ndarray:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import dequantize

    qtype = GGMLQuantizationType(info.qtype)
    block, size = GGML_QUANT_SIZES[qtype]
    count = int(np.prod(info.dims))
    raw = np.frombuffer(buffer, np.uint8, count // block * size, start + info.offset)
    rows = raw.reshape(-1, info.dims[0] // block * size)
    return dequantize(rows, qtype).astype(np.float32).reshape(info.dims[::-1])


def _config(meta: dict[str, Any], tied: bool, vocab_size: int) -> dict[str, Any]:
    heads = meta["llama.attention.head_count"]
    hidden = meta["llama.embedding_length"]
    tokens = {k: meta.get(f"tokenizer.ggml.{k}_token_id") for k in ("bos", "eos", "padding")}
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "dtype": "float32",
        "vocab_size": vocab_size,
        "hidden_size": hidden,
        "intermediate_size": meta["llama.feed_forward_length"],
        "num_hidden_layers": meta["llama.block_count"],
        "num_attention_heads": heads,
        "num_key_value_heads": meta.get("llama.attention.head_count_kv", heads),
        "head_dim": meta.get("llama.attention.key_length", hidden // heads),
        "hidden_act": "silu",
        "max_position_embeddings": meta["llama.context_length"],
        "rms_norm_eps": meta["llama.attention.layer_norm_rms_epsilon"],
        "rope_parameters": {"rope_theta": meta["llama.rope.freq_base"], "rope_type": "default"},
        "tie_word_embeddings": tied,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": tokens["bos"],
        "eos_token_id": tokens["eos"],
        "pad_token_id": tokens["padding"],
    }


def _weights(
    meta: dict[str, Any], infos: list[TensorInfo], buffer: mmap.mmap, start: int
) -> dict[str, torch.Tensor]:
    """Every tensor dequantized to float32 under its Hugging Face name, q/k rows reordered back."""
    heads = meta["llama.attention.head_count"]
    kv_heads = meta.get("llama.attention.head_count_kv", heads)
    state = {}
    for info in infos:
        weight = _tensor(buffer, start, info)
        if info.name.endswith("attn_q.weight"):
            weight = unpermute(weight, heads)
        elif info.name.endswith("attn_k.weight"):
            weight = unpermute(weight, kv_heads)
        state[str(_hf_name(info.name))] = torch.from_numpy(np.ascontiguousarray(weight))
    return state


def convert_llama(gguf_path: Path, target: Path) -> bool:
    """Write config.json and model.safetensors for a plain Llama GGUF file into `target`;
    False (nothing written) for any other file; ModelNotFoundError (nothing written) for a
    Llama file that lacks what a Llama model needs."""
    with gguf_path.open("rb") as file:
        meta, infos, start, buffer = read_header(file)
        try:
            plain = meta.get("general.architecture") == "llama" and not any(
                key.startswith("llama.rope.scaling") for key in meta
            )
            known = all(_hf_name(info.name) is not None for info in infos)
            if not (plain and known and "llama.rope.freq_base" in meta):
                return False
            state = _weights(meta, infos, buffer, start)
            vocab_size = state["model.embed_tokens.weight"].shape[0]
            config = _config(meta, "lm_head.weight" not in state, vocab_size)
        except (ValueError, KeyError) as exc:  # a key or tensor missing, a type unknown
            raise ModelNotFoundError(
                f"{gguf_path} is an incomplete Llama GGUF file ({exc!r})"
            ) from None
        finally:
            buffer.close()
    (target / "config.json").write_text(json.dumps(config, indent=2))
    save_file(state, str(target / "model.safetensors"))
    return True
