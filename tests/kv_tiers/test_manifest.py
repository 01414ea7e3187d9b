"""The disk tier's directory: a matching fingerprint reuses it, another one leaves it alone
(or empties it when asked), a per-process hash seed is never reused, one owner at a time."""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import pytest

from blockserve.errors import InvalidConfigError
from blockserve.kv_tiers.manifest import MANIFEST, Fingerprint, model_content_hash, open_directory

PRINT = Fingerprint("ab" * 16, "bfloat16", 16, "sha256", "cd" * 32, 30, 3, 64)


def with_a_block(root: Path) -> Path:
    block = root / "blocks" / "aa" / ("aa" * 32 + ".kv")
    block.parent.mkdir(parents=True)
    block.write_bytes(b"x")
    return block


def test_a_matching_directory_keeps_its_blocks(tmp_path: Path) -> None:
    open_directory(tmp_path, PRINT).close()
    block = with_a_block(tmp_path)
    directory = open_directory(tmp_path, PRINT)
    assert directory.usable and block.exists()
    assert json.loads((tmp_path / MANIFEST).read_text())["model_hash"] == PRINT.model_hash
    directory.close()


def test_another_fingerprint_leaves_the_directory_alone_with_one_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    open_directory(tmp_path, PRINT).close()
    block = with_a_block(tmp_path)
    other = dataclasses.replace(PRINT, block_size=32, dtype="float32")
    with caplog.at_level(logging.WARNING, "blockserve.kv_tiers.manifest"):
        directory = open_directory(tmp_path, other)
    assert not directory.usable and block.exists()
    (line,) = [r.getMessage() for r in caplog.records]
    assert "KV disk tier OFF" in line and "dtype, block_size differ" in line
    assert json.loads((tmp_path / MANIFEST).read_text())["block_size"] == 16
    directory.close()


def test_clear_on_mismatch_empties_it_and_adopts_it(tmp_path: Path) -> None:
    open_directory(tmp_path, PRINT).close()
    block = with_a_block(tmp_path)
    other = dataclasses.replace(PRINT, model_hash="ef" * 16)
    directory = open_directory(tmp_path, other, clear_on_mismatch=True)
    assert directory.usable and not block.exists()
    assert json.loads((tmp_path / MANIFEST).read_text())["model_hash"] == "ef" * 16
    directory.close()


def test_blocks_without_a_manifest_are_not_trusted(tmp_path: Path) -> None:
    block = with_a_block(tmp_path)
    directory = open_directory(tmp_path, PRINT)
    assert not directory.usable and block.exists()
    directory.close()


def test_a_per_process_seed_is_marked_and_emptied_by_the_next_start(tmp_path: Path) -> None:
    random = dataclasses.replace(PRINT, hash_algo="xxhash", reusable=False)
    open_directory(tmp_path, random).close()
    assert json.loads((tmp_path / MANIFEST).read_text())["reusable"] is False
    block = with_a_block(tmp_path)
    directory = open_directory(tmp_path, random)  # the same settings: still nothing reusable
    assert directory.usable and not block.exists()
    directory.close()


def test_one_process_at_a_time(tmp_path: Path) -> None:
    first = open_directory(tmp_path, PRINT)
    with pytest.raises(InvalidConfigError, match="in use by another process"):
        open_directory(tmp_path, PRINT)
    first.close()
    open_directory(tmp_path, PRINT).close()


def test_the_model_hash_follows_the_weights(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"\x00" * 100)
    before = model_content_hash(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"\x00" * 99 + b"\x01")
    assert model_content_hash(tmp_path) != before and len(before) == 32


def test_a_directory_written_before_tagged_extra_keys_is_not_served(tmp_path: Path) -> None:
    """Format 1 keyed salted and adapter blocks by untagged extra keys: such a directory,
    otherwise the same, is left alone (the shared store's namespace, a digest of the same
    fingerprint, changes with it)."""
    open_directory(tmp_path, PRINT).close()
    block = with_a_block(tmp_path)
    old = {**json.loads((tmp_path / MANIFEST).read_text()), "format": 1}
    (tmp_path / MANIFEST).write_text(json.dumps(old))
    directory = open_directory(tmp_path, PRINT)
    assert not directory.usable and block.exists()
    assert PRINT.to_json()["format"] == 2
    directory.close()
