"""Adapters written to hurt: every malformed config, a header that lies about its tensors, a
rank above `r`, bad names: each refused at load with its reason and nothing changed; a name
pointed at other weights never reads the old ones' blocks; an adapter unloaded between a
request's check and its arrival fails that request alone."""

from __future__ import annotations

import json
import os
import shutil
import struct
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from blockserve import LLM, LoRARequest, SamplingParams
from blockserve.engine.request import RequestSpec
from blockserve.errors import ModelNotFoundError
from blockserve.lora.names import LoRAError
from tests.lora.test_lora import GREEDY, PROMPTS, make_llm, reference

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"


@pytest.fixture(scope="module")
def llm(tiny_llama_dir: Path, adapters: dict[str, Path]) -> LLM:
    return make_llm(tiny_llama_dir, max_loras=2, lora_modules=(f"every={adapters['every']}",))


def copy_of(adapter: Path, tmp: Path, name: str) -> Path:
    out = tmp / name
    shutil.copytree(adapter, out)
    return out


def write_raw_safetensors(path: Path, header: dict, data_bytes: int) -> None:
    """A safetensors file with `header` (data offsets as given) and a sparse data section of
    `data_bytes`: its apparent size is what the header claims, its disk use a few KB."""
    raw = json.dumps(header).encode()
    with path.open("wb") as file:
        file.write(struct.pack("<Q", len(raw)) + raw)
    os.truncate(path, 8 + len(raw) + data_bytes)


def claim_huge_a(adapter: Path) -> None:
    """Layer 0's q_proj A is declared [1048576, 64] float32 (256 MiB) in a sparse file."""
    tensors = load_file(str(adapter / WEIGHTS))
    header, offset = {}, 0
    for key in sorted(tensors):
        shape = list(tensors[key].shape)
        if key.endswith("layers.0.self_attn.q_proj.lora_A.weight"):
            shape = [1 << 20, 64]
        size = 4 * shape[0] * shape[1]
        header[key] = {"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    write_raw_safetensors(adapter / WEIGHTS, header, offset)


def v_proj_rank(adapter: Path, rank: int) -> None:
    """Layer 0's v_proj A and B of another rank than the config's `r`."""
    tensors = load_file(str(adapter / WEIGHTS))
    for key in list(tensors):
        if "layers.0.self_attn.v_proj.lora_A" in key:
            tensors[key] = torch.ones(rank, 64)
        if "layers.0.self_attn.v_proj.lora_B" in key:
            tensors[key] = torch.ones(32, rank)
    save_file(tensors, str(adapter / WEIGHTS))


def nan_weights(adapter: Path) -> None:
    tensors = load_file(str(adapter / WEIGHTS))
    key = next(k for k in sorted(tensors) if "layers.1.mlp.up_proj.lora_B" in k)
    tensors[key][3, 1] = float("nan")
    save_file(tensors, str(adapter / WEIGHTS))


def int_tensors(adapter: Path) -> None:
    tensors = load_file(str(adapter / WEIGHTS))
    save_file({k: v.to(torch.int32) for k, v in tensors.items()}, str(adapter / WEIGHTS))


def truncated(adapter: Path) -> None:
    data = (adapter / WEIGHTS).read_bytes()
    (adapter / WEIGHTS).write_bytes(data[:-100])


def config_text(text: str | bytes) -> Callable[[Path], None]:
    def change(adapter: Path) -> None:
        path = adapter / CONFIG
        path.write_bytes(text if isinstance(text, bytes) else text.encode())

    return change


def config_links_to_binary(adapter: Path) -> None:
    (adapter / "blob.bin").write_bytes(bytes(range(256)))
    (adapter / CONFIG).unlink()
    (adapter / CONFIG).symlink_to(adapter / "blob.bin")


DEEP = "[" * 30_000 + "]" * 30_000
A_SHAPE = "with r = 4 the model needs A [4, 64] and B [64, 4]"
BAD_ADAPTERS = [
    ("r-text", config_text('{"r": "abc"}'), "r must be an integer, got abc"),
    ("r-too-big", config_text('{"r": 1e400}'), "r must be an integer, got inf"),
    ("r-nan", config_text('{"r": NaN}'), "r must be an integer, got nan"),
    ("r-negative", config_text('{"r": -3}'), "rank -3"),
    (
        "alpha-nan",
        config_text('{"r": 4, "lora_alpha": NaN}'),
        "lora_alpha must be a finite number, got nan",
    ),
    ("a-list", config_text("[4, 8]"), "adapter_config.json is not a JSON object"),
    ("deep", config_text(DEEP), "adapter_config.json is not a JSON object"),
    ("not-utf8", config_text(b"\xff\xfe{}"), "adapter_config.json is not a JSON object"),
    ("huge-config", config_text(" " * 70_000 + "{}"), "adapter_config.json is over 65536 bytes"),
    ("link-to-binary", config_links_to_binary, "adapter_config.json is not a JSON object"),
    (
        "header-claims-256mib",
        claim_huge_a,
        f"q_proj of layer 0 has A [1048576, 64] and B [64, 4]; {A_SHAPE}",
    ),
    (
        "rank-above-r",
        lambda a: v_proj_rank(a, 24),
        "v_proj of layer 0 has A [24, 64] and B [32, 24]; with r = 4 the model needs "
        "A [4, 64] and B [32, 4]",
    ),
    (
        "int-weights",
        int_tensors,
        "base_model.model.model.layers.0.mlp.down_proj.lora_A.weight is not a float32, float16 "
        "or bfloat16 tensor",
    ),
    ("nan-weights", nan_weights, "up_proj of layer 1 has weights that are NaN or infinite"),
    (
        "truncated",
        truncated,
        "adapter_model.safetensors is {size} bytes, its header describes {described}",
    ),
]


@pytest.mark.parametrize(
    ("case", "change", "reason"), BAD_ADAPTERS, ids=[c[0] for c in BAD_ADAPTERS]
)
def test_a_bad_adapter_is_refused_at_load_and_changes_nothing(
    llm: LLM, adapters: dict[str, Path], tmp_path: Path, case: str, change: Callable, reason: str
) -> None:
    """Each is a LoRAError naming the adapter and the reason, raised before any weight is
    read; the engine serves what it served before."""
    path = copy_of(adapters["every"], tmp_path, case)
    original_size = (path / WEIGHTS).stat().st_size
    change(path)
    reason = reason.format(size=original_size - 100, described=original_size)
    with pytest.raises(LoRAError) as error:
        llm.engine.add_lora("bad", str(path))
    assert str(error.value) == f"LoRA adapter 'bad' ({path}): {reason}"
    assert sorted(llm.engine.lora_manager().registry) == ["every"]


def test_a_path_too_long_for_the_system_is_refused(llm: LLM) -> None:
    path = "/tmp/" + "x" * 5000
    with pytest.raises(LoRAError) as error:
        llm.engine.add_lora("long", path)
    assert str(error.value) == (
        f"LoRA adapter 'long' ({path[:200]}): cannot read adapter_config.json: File name too long"
    )


@pytest.mark.parametrize(
    ("name", "reason"),
    [
        ("", "a LoRA adapter needs a name that is not blank, got ''"),
        ("   ", "a LoRA adapter needs a name that is not blank, got '   '"),
        ("a\nb", "a LoRA adapter's name has no commas or control characters, got 'a\\nb'"),
        ("a,b", "a LoRA adapter's name has no commas or control characters, got 'a,b'"),
        ("a\u200bb", "a LoRA adapter's name has no commas or control characters, got 'a\\u200bb'"),
        ("x" * 257, "a LoRA adapter's name is at most 256 characters, got 257"),
    ],
)
def test_names_are_checked(llm: LLM, adapters: dict[str, Path], name: str, reason: str) -> None:
    with pytest.raises(LoRAError) as error:
        llm.engine.add_lora(name, str(adapters["qv"]))
    assert str(error.value) == reason
    assert sorted(llm.engine.lora_manager().registry) == ["every"]


def test_a_name_pointed_at_other_weights_reads_none_of_the_old_blocks(
    tiny_llama_dir: Path, adapters: dict[str, Path], tmp_path: Path
) -> None:
    """`tuned` from one path, unloaded, then from another path; then from a path whose files
    were replaced; then that content again: hits 0, 0, 0, 32, and each time the tokens of the
    weights loaded last (transformers + peft)."""
    llm = make_llm(tiny_llama_dir, max_loras=1)
    prompt = {"prompt_token_ids": PROMPTS[1]}
    swapped = copy_of(adapters["every"], tmp_path, "swapped")

    def run(path: Path) -> tuple[int | None, list[int]]:
        lora = LoRARequest("tuned", 1, str(path))
        output = llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=lora)[0]
        llm.engine.remove_lora("tuned")
        return output.num_cached_tokens, list(output.outputs[0].token_ids)

    every = reference(tiny_llama_dir, adapters["every"], PROMPTS[1])[0]
    qv = reference(tiny_llama_dir, adapters["qv"], PROMPTS[1])[0]
    assert run(adapters["every"]) == (0, every)
    assert run(adapters["qv"]) == (0, qv)  # another path
    assert run(swapped) == (0, every)
    for name in (CONFIG, WEIGHTS):  # the same path, other files
        shutil.copy(adapters["qv"] / name, swapped / name)
    assert run(swapped) == (0, qv)
    assert run(swapped) == (32, qv)  # the same content again: its blocks


def test_an_adapter_unloaded_after_its_request_was_checked_fails_that_request_alone(
    llm: LLM, adapters: dict[str, Path], tiny_llama_dir: Path
) -> None:
    """The race of a server: a request checked on a tokenizer thread, its adapter unloaded
    on the engine's before the request arrives there. The request is refused (404-style),
    nothing is queued, and the engine goes on serving the others."""
    engine = llm.engine
    engine.add_lora("brief", str(adapters["qv"]))
    spec = RequestSpec("late", tuple(PROMPTS[0]), GREEDY, lora_name="brief")
    checked = engine.input_processor.process(spec, ())
    engine.remove_lora("brief")
    with pytest.raises(ModelNotFoundError) as error:
        engine.add_validated(checked)
    assert str(error.value) == "The lora adapter 'brief' cannot be found."
    assert not engine.has_unfinished_requests()
    output = llm.generate({"prompt_token_ids": PROMPTS[0]}, GREEDY, use_tqdm=False)[0]
    assert list(output.outputs[0].token_ids) == reference(tiny_llama_dir, None, PROMPTS[0])[0]


def test_a_disk_tier_never_serves_an_adapters_blocks_for_other_weights_at_its_path(
    tiny_llama_dir: Path, adapters: dict[str, Path], tmp_path: Path
) -> None:
    """`tuned` at one path fills a disk tier; the files at that path are replaced and the
    engine restarted on the same directory: the tier's blocks for the old weights are not
    read (0 tokens from disk, tokens of the new weights), and once the new weights' blocks
    are written, a third engine hits them (64 tokens from disk)."""
    path = copy_of(adapters["every"], tmp_path, "tuned")
    prompt = [(t * 3) % 290 + 5 for t in range(80)]  # 4 hittable blocks
    lora = LoRARequest("tuned", 1, str(path))
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)

    def run(**tiers: object) -> tuple[int | None, dict[str, int], list[int]]:
        llm = LLM(str(tiny_llama_dir), dtype="float32", enable_lora=True, max_lora_rank=8,
                  num_gpu_blocks_override=12, **tiers)  # fmt: skip
        try:
            (out,) = llm.generate({"prompt_token_ids": prompt}, greedy, use_tqdm=False,
                                  lora_request=lora)  # fmt: skip
        finally:
            llm.shutdown()  # flushes the disk tier's writes, frees the directory
        return out.num_cached_tokens, dict(out.tier_cached_tokens), list(out.outputs[0].token_ids)

    kv = str(tmp_path / "kv")
    run(kv_cache_dir=kv)
    for name in (CONFIG, WEIGHTS):
        shutil.copy(adapters["qv"] / name, path / name)
    _, _, fresh = run(enable_prefix_caching=False)
    assert run(kv_cache_dir=kv) == (0, {}, fresh)
    assert run(kv_cache_dir=kv) == (64, {"disk": 64}, fresh)
