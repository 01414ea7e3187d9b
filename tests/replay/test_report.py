"""Replay reports: the `blockserve replay` command's table, JSON and plot."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.replay.test_simulate import HAND_TRACE


def write_hand_trace(path: Path) -> Path:
    """HAND_TRACE as a Mooncake-format JSONL file at `path`."""
    rows = (
        {"timestamp": 0, "input_length": r.input_length, "output_length": 0,
         "hash_ids": list(r.hash_ids)}
        for r in HAND_TRACE
    )  # fmt: skip
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.mark.slow
def test_replay_command_writes_table_json_and_plot(tmp_path: Path) -> None:
    """`blockserve replay` prints the table and writes replay.json and replay.png."""
    path = write_hand_trace(tmp_path / "trace.jsonl")
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


@pytest.mark.slow
def test_replay_cli_errors_are_one_line_and_output_avoids_the_tree(tmp_path: Path) -> None:
    """A missing trace: exit 2 and one line on stderr. No --out-dir: the reports go to a new
    folder under the temporary directory, never into the working tree."""

    def replay(*args: str) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-m", "blockserve.cli", "replay", *args, "--no-progress"]
        return subprocess.run(command, capture_output=True, text=True, cwd=tmp_path)

    missing = replay("missing.jsonl")
    assert missing.returncode == 2 and missing.stdout == ""
    assert missing.stderr.splitlines() == [
        "blockserve replay: cannot read the trace missing.jsonl: No such file or directory"
    ]
    trace = tmp_path / "trace.jsonl"
    trace.write_text(
        json.dumps({"timestamp": 0, "input_length": 9, "output_length": 0, "hash_ids": [1, 2, 3]})
        + "\n"
    )
    done = replay(str(trace), "--trace-block-size", "4", "--capacities", "4")
    assert done.returncode == 0, done.stderr
    written = Path(done.stdout.splitlines()[-1].split()[1])
    assert written.name == "replay.json" and written.parent.name.startswith("blockserve-replay-")
    assert Path(tempfile.gettempdir()) in written.parents and written.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["trace.jsonl"]
    shutil.rmtree(written.parent)
