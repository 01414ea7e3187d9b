"""Default sampling parameters from generation_config.json (`--generation-config`)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from blockserve import LLM, SamplingParams
from blockserve.engine.generation_config import default_sampling
from blockserve.errors import InvalidConfigError

CONFIG = {
    "bos_token_id": 1,
    "do_sample": True,  # not a sampling default vLLM reads: ignored
    "temperature": 0,
    "top_p": 0.9,
    "top_k": 20,
    "repetition_penalty": 1.1,
    "max_new_tokens": 5,
}
DEFAULTS = {
    "temperature": 0.0,
    "top_p": 0.9,
    "top_k": 20,
    "repetition_penalty": 1.1,
    "max_tokens": 5,
}


def write(path: Path, config: object) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "generation_config.json").write_text(json.dumps(config))
    return path


def test_auto_reads_the_model_directory(tmp_path: Path) -> None:
    assert default_sampling(write(tmp_path, CONFIG), "auto") == DEFAULTS
    assert default_sampling(tmp_path / "elsewhere", "auto") == {}  # no file: no defaults


def test_vllm_reads_nothing(tmp_path: Path) -> None:
    assert default_sampling(write(tmp_path, CONFIG), "vllm") == {}


def test_a_path_names_the_file_or_its_directory(tmp_path: Path) -> None:
    folder = write(tmp_path / "override", {"temperature": 0.5})
    assert default_sampling(tmp_path, str(folder)) == {"temperature": 0.5}
    assert default_sampling(tmp_path, str(folder / "generation_config.json")) == {
        "temperature": 0.5
    }
    with pytest.raises(InvalidConfigError, match=r"no generation_config\.json there"):
        default_sampling(tmp_path, str(tmp_path / "missing"))


@pytest.mark.parametrize(
    ("config", "words"),
    [
        ({"temperature": "hot"}, "temperature in .* is 'hot', not a number"),
        ({"top_k": 2.5}, "top_k in .* is 2.5, not an integer"),
        ({"top_p": True}, "top_p in .* is True, not a number"),
        ([1, 2], "does not hold a JSON object"),
    ],
)
def test_bad_files_are_refused(tmp_path: Path, config: object, words: str) -> None:
    with pytest.raises(InvalidConfigError, match=words):
        default_sampling(write(tmp_path, config), "auto")


@pytest.fixture(scope="module")
def configured_model(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    model = tmp_path_factory.mktemp("with-generation-config") / "model"
    shutil.copytree(tiny_llama_dir, model)
    return write(model, CONFIG)


def test_llm_uses_the_defaults_when_given_no_params(configured_model: Path) -> None:
    llm = LLM(str(configured_model), dtype="float32", num_gpu_blocks_override=64)
    assert llm.get_default_sampling_params() == SamplingParams(**DEFAULTS)  # type: ignore[arg-type]
    out = llm.generate([list(range(10, 30))], use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) <= 5
    ignored = LLM(
        str(configured_model), dtype="float32", num_gpu_blocks_override=64, generation_config="vllm"
    )
    assert ignored.get_default_sampling_params() == SamplingParams()
