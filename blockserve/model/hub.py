"""Hugging Face hub ids resolved as vLLM resolves them: through huggingface_hub's cache
(HF_HOME, HF_HUB_CACHE, or --download-dir), fetching what is missing unless HF_HUB_OFFLINE=1,
with HF_TOKEN for gated models; only the files a model of ours loads."""

from __future__ import annotations

from pathlib import Path

from blockserve.errors import ModelNotFoundError

# What the loader reads: config, weights, tokenizer and chat template files.
MODEL_FILES = ("*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken")
TOKENIZER_FILES = ("*.json", "*.model", "*.txt", "*.jinja", "*.tiktoken")


def is_hub_id(model: str) -> bool:
    """Whether `model` names a hub repository (`name` or `namespace/name`) rather than a
    path: nothing exists at it and the hub would take it as an id."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    if Path(model).expanduser().exists():
        return False
    try:
        validate_repo_id(model)
    except HFValidationError:
        return False
    return True


def snapshot(
    repo_id: str,
    revision: str | None = None,
    download_dir: str | None = None,
    files: tuple[str, ...] = MODEL_FILES,
) -> Path:
    """The local snapshot of `repo_id` at `revision` (default: main), downloaded into the
    cache where missing (with huggingface_hub's progress bars); ModelNotFoundError in one
    line when it cannot be had."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    where = f"{repo_id}" + (f" at revision {revision!r}" if revision else "")
    try:
        return Path(
            snapshot_download(
                repo_id, revision=revision, cache_dir=download_dir, allow_patterns=list(files)
            )
        )
    except GatedRepoError:
        raise ModelNotFoundError(
            f"{repo_id} is gated on the hub: accept its terms there and set HF_TOKEN"
        ) from None
    except RevisionNotFoundError:
        raise ModelNotFoundError(f"{where}: the hub has no such revision") from None
    except RepositoryNotFoundError:
        raise ModelNotFoundError(
            f"{repo_id}: no such model on the hub (a private one needs HF_TOKEN)"
        ) from None
    except LocalEntryNotFoundError as error:
        cause = error.__cause__ or error
        raise ModelNotFoundError(
            f"{where} is not in the local cache and the hub cannot be reached: "
            f"{type(cause).__name__}: {str(cause).splitlines()[0] if str(cause) else ''}"
        ) from None


def tokenizer_dir(name: str, download_dir: str | None = None) -> Path:
    """--tokenizer's directory: a path, or a hub id's snapshot of its tokenizer files."""
    if is_hub_id(name):
        return snapshot(name, download_dir=download_dir, files=TOKENIZER_FILES)
    path = Path(name).expanduser()
    if not path.is_dir():
        raise ModelNotFoundError(f"no tokenizer at {name!r}: expected a directory or a hub id")
    return path
