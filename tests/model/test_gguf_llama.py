"""The fast Llama GGUF converter writes what transformers' converter writes, tensor for tensor,
and leaves any other file to transformers."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from blockserve.errors import ModelNotFoundError
from blockserve.model.gguf_llama import convert_llama, read_header
from blockserve.model.loader import convert_gguf, default_model_path


@pytest.mark.slow
def test_the_default_model_converts_exactly_as_transformers_converts_it(tmp_path: Path) -> None:
    source = default_model_path()
    assert convert_llama(source, tmp_path)
    ours = load_file(str(tmp_path / "model.safetensors"))
    reference = AutoModelForCausalLM.from_pretrained(
        str(source.parent), gguf_file=source.name, dtype=torch.float32
    )
    expected = reference.state_dict()
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["tie_word_embeddings"] is reference.config.tie_word_embeddings is True
    expected.pop("lm_head.weight")  # tied: the embedding is the head
    assert set(ours) == set(expected)
    assert [name for name in expected if not torch.equal(ours[name], expected[name])] == []
    for field in (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "max_position_embeddings",
        "rms_norm_eps",
        "rope_parameters",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
    ):
        assert config[field] == getattr(reference.config, field), field


@pytest.mark.slow
def test_the_default_models_tokenizer_files_are_what_autotokenizer_writes(tmp_path: Path) -> None:
    """The generic class built straight from the file writes AutoTokenizer's files, byte for
    byte (AutoTokenizer reads the model's config out of the file first, and then builds the
    same class)."""
    source = default_model_path()
    converted = convert_gguf(source, tmp_path / "cache")
    reference = tmp_path / "reference"
    AutoTokenizer.from_pretrained(str(source.parent), gguf_file=source.name).save_pretrained(
        reference
    )
    names = sorted(path.name for path in reference.iterdir())
    assert names == ["chat_template.jinja", "tokenizer.json", "tokenizer_config.json"]
    differ = [
        name for name in names if (converted / name).read_bytes() != (reference / name).read_bytes()
    ]
    assert differ == []


def write_gguf(path: Path, architecture: str, tensor_name: str) -> None:
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_uint32(f"{architecture}.block_count", 2)
    writer.add_float32(f"{architecture}.rope.freq_base", 10000.0)
    writer.add_array("tokenizer.ggml.tokens", ["a", "b"])
    writer.add_tensor(tensor_name, torch.ones(4, 8).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_a_file_of_another_architecture_is_left_to_transformers(tmp_path: Path) -> None:
    path = tmp_path / "qwen.gguf"
    write_gguf(path, "qwen2", "token_embd.weight")
    target = tmp_path / "out"
    target.mkdir()

    with path.open("rb") as file:
        metadata, tensors, _, buffer = read_header(file)
        buffer.close()
    assert metadata["general.architecture"] == "qwen2"
    assert metadata["qwen2.block_count"] == 2
    assert metadata["tokenizer.ggml.tokens"] == ["a", "b"]
    assert [(t.name, t.dims) for t in tensors] == [("token_embd.weight", (8, 4))]
    assert not convert_llama(path, target)
    assert list(target.iterdir()) == []

    unknown = tmp_path / "llama-extra.gguf"  # a llama file with a tensor we cannot name
    write_gguf(unknown, "llama", "blk.0.attn_q_norm.weight")
    assert not convert_llama(unknown, target)
    assert list(target.iterdir()) == []


def test_a_file_that_is_not_gguf_is_refused_with_a_typed_error(tmp_path: Path) -> None:
    path = tmp_path / "broken.gguf"
    path.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\x01" * 5)  # the header stops mid-count
    with pytest.raises(ModelNotFoundError, match="not a readable GGUF file"):
        convert_llama(path, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["broken.gguf"]


def test_a_llama_file_missing_its_dimensions_is_refused_and_writes_nothing(tmp_path: Path) -> None:
    path = tmp_path / "bare-llama.gguf"
    write_gguf(path, "llama", "token_embd.weight")  # no embedding_length, head_count, ...
    target = tmp_path / "out"
    target.mkdir()
    with pytest.raises(ModelNotFoundError, match="incomplete Llama GGUF file"):
        convert_llama(path, target)
    assert list(target.iterdir()) == []
