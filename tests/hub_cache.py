"""A model directory laid out as huggingface_hub caches a snapshot, for hub-id tests offline
(no hub is reachable here)."""

from __future__ import annotations

import hashlib
from pathlib import Path


def add_snapshot(
    cache: Path, repo_id: str, commit: str, model_dir: Path, refs: tuple[str, ...]
) -> Path:
    """`model_dir`'s files as huggingface_hub caches a snapshot: each file a blob named by its
    hash, the snapshot a folder of relative links to them, each ref a file with the commit."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir(exist_ok=True)
    for file in sorted(model_dir.iterdir()):
        blob = hashlib.sha256(file.read_bytes()).hexdigest()
        (repo / "blobs" / blob).write_bytes(file.read_bytes())
        (snapshot / file.name).symlink_to(Path("..") / ".." / "blobs" / blob)
    (repo / "refs").mkdir(exist_ok=True)
    for ref in refs:
        (repo / "refs" / ref).write_text(commit)
    return snapshot
