"""The disk tier's directory: its fingerprint, its lock, and whether its blocks may be reused."""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Any

import xxhash

from blockserve.errors import InvalidConfigError

logger = logging.getLogger(__name__)

MANIFEST = "manifest.json"
_FORMAT = 2  # 2: block hashes take vLLM 0.32's tagged extra keys
_CHUNK = 8 << 20


@dataclass(frozen=True, slots=True)
class Fingerprint:
    """Everything that makes a stored block the right KV for its hash."""

    model_hash: str
    dtype: str
    block_size: int
    hash_algo: str
    none_hash: str  # hex: the hash seed's fingerprint
    num_layers: int
    num_kv_heads: int
    head_dim: int
    reusable: bool = True  # False when the hash seed is random per process

    def to_json(self) -> dict[str, Any]:
        return {"format": _FORMAT, **asdict(self)}

    def namespace(self) -> str:
        """A short digest of it: the remote store's key prefix, so that two models or two
        cache setups never read each other's blocks."""
        canonical = json.dumps(self.to_json(), sort_keys=True).encode()
        return hashlib.sha256(canonical).hexdigest()[:16]


def model_content_hash(model_dir: Path) -> str:
    """xxh3-128 over the model's config.json and weight files (names and bytes, in order)."""
    digest = xxhash.xxh3_128()
    files = [model_dir / "config.json", *sorted(model_dir.glob("*.safetensors"))]
    for path in files:
        digest.update(path.name.encode() + b"\0")
        with open(path, "rb") as file:
            while chunk := file.read(_CHUNK):
                digest.update(chunk)
    return digest.hexdigest()


@dataclass(slots=True)
class DiskDirectory:
    """An opened disk-tier directory; `usable` False when its fingerprint did not match.

    A block on disk is only the right KV for its hash under the exact conditions it was computed
    in. `manifest.json` records them — the model's content hash, the KV dtype, the block size,
    the hash algorithm and its NONE_HASH (which carries the seed), the layer count, KV heads and
    head dimension — and a server opening the directory compares them with its own:

    - the same fingerprint: the blocks are served at once (a warm restart);
    - a different one: the directory is left alone and the disk tier is off, with one log line,
      unless `clear_on_mismatch`, which empties it and starts over;
    - a hash seed that is random per process (xxhash without PYTHONHASHSEED): no later process
      can reuse a block, so the directory is marked not reusable and emptied by the next start.

    One process at a time owns a directory (an exclusive `flock` on `lock`, held until closed):
    two writers would evict each other's blocks out from under their indexes.
    """

    root: Path
    usable: bool
    _lock: IO[bytes] | None

    def close(self) -> None:
        if self._lock is not None:
            self._lock.close()  # releases the flock
            self._lock = None


def open_directory(
    root: Path | str, fingerprint: Fingerprint, clear_on_mismatch: bool = False
) -> DiskDirectory:
    """Lock `root` and reconcile its manifest with `fingerprint` (see the module docstring).

    Raises InvalidConfigError when another process holds the directory.
    """
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    lock = open(root / "lock", "wb")  # noqa: SIM115 (held until close)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.close()
        raise InvalidConfigError(
            f"the KV cache directory {root} is in use by another process (or by another "
            "engine of this one that was not shut down)"
        ) from None
    found = _read_manifest(root)
    wanted = fingerprint.to_json()
    has_blocks = (root / "blocks").exists() and any((root / "blocks").iterdir())
    if found == wanted and fingerprint.reusable:
        logger.info("KV disk tier: %s matches this model and cache; its blocks are served", root)
    elif found is not None and found.get("reusable") is False:
        _clear(root, "it was written with a per-process hash seed")
    elif found is not None or has_blocks:
        differs = _differences(found, wanted)
        if not clear_on_mismatch:
            logger.warning(
                "KV disk tier OFF: %s was written for another model or cache (%s differ); it is "
                "left as it is (--kv-cache-dir-clear-mismatch empties it instead)",
                root,
                differs,
            )
            return DiskDirectory(root, False, lock)
        _clear(root, f"{differs} differ and --kv-cache-dir-clear-mismatch is set")
    if not fingerprint.reusable:
        logger.warning(
            "KV disk tier: %s hashes use a random per-process seed (PYTHONHASHSEED is unset), "
            "so %s will not be reused after a restart; set PYTHONHASHSEED to keep it",
            fingerprint.hash_algo,
            root,
        )
    _write_manifest(root, wanted)
    return DiskDirectory(root, True, lock)


def _read_manifest(root: Path) -> dict[str, Any] | None:
    try:
        value = json.loads((root / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def _write_manifest(root: Path, manifest: dict[str, Any]) -> None:
    temp = root / f"{MANIFEST}.tmp{os.getpid()}"
    temp.write_text(json.dumps(manifest, indent=2) + "\n")
    os.replace(temp, root / MANIFEST)


def _differences(found: dict[str, Any] | None, wanted: dict[str, Any]) -> str:
    if found is None:
        return "the manifest is missing; its blocks' model and cache"
    return ", ".join(key for key in wanted if found.get(key) != wanted[key]) or "format"


def _clear(root: Path, why: str) -> None:
    logger.warning("KV disk tier: emptying %s: %s", root, why)
    shutil.rmtree(root / "blocks", ignore_errors=True)
    (root / MANIFEST).unlink(missing_ok=True)
