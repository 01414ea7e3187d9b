"""Replay reports: the `blockserve replay` command's table, JSON and plot."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.replay.test_simulate import HAND_TRACE


def test_replay_command_writes_table_json_and_plot(tmp_path: Path) -> None:
    """`blockserve replay` prints the table and writes replay.json and replay.png."""
    path = tmp_path / "trace.jsonl"
    path.write_text(
        "".join(
            json.dumps(
                {
                    "timestamp": 0,
                    "input_length": r.input_length,
                    "output_length": 0,
                    "hash_ids": list(r.hash_ids),
                }
            )
            + "\n"
            for r in HAND_TRACE
        )
    )
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "blockserve.cli",
            "replay",
            str(path),
            "--trace-block-size",
            "4",
            "--capacities",
            "4,8",
            "--out-dir",
            str(tmp_path / "out"),
            "--no-progress",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "lru hit%" in out and "belady hit%" in out
    report = json.loads((tmp_path / "out" / "replay.json").read_text())
    rows = {(r["policy"], r["capacity_blocks"]): r for r in report["results"]}
    assert rows[("lru", 4)]["hit_blocks"] == 2 and rows[("belady", 4)]["hit_blocks"] == 4
    # 2 capacities x (6 policies + 2 bounds + the one-pass LRU estimate)
    assert len(report["results"]) == 2 * 9
    assert rows[("lru-estimate", 4)]["hit_blocks"] == rows[("lru", 4)]["hit_blocks"]
    assert (tmp_path / "out" / "replay.png").read_bytes()[:4] == b"\x89PNG"
