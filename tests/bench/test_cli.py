"""`blockserve bench`: each subcommand runs the real benchmark and prints one JSON document
stamped with the host; `bench replay` is `blockserve replay`."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from blockserve.bench import offline
from blockserve.bench.harness import cpu_flags
from tests.replay.test_report import write_hand_trace


def blockserve(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "blockserve.cli", *args]
    return subprocess.run(command, capture_output=True, text=True, cwd=cwd, check=True)


@pytest.mark.slow
def test_bench_offline_measures_the_engine_with_caching_on_and_off(tmp_path: Path) -> None:
    """Two requests on one 1,024-token prefix (66 blocks each): with caching the second finds
    the first's 64 whole prefix blocks, 64 of the 132 looked up; without, none."""
    out = tmp_path / "offline.json"
    args = ["--workload", "shared-prefix", "--requests", "2", "--max-tokens", "2"]
    done = blockserve("bench", "offline", *args, "--out", str(out), "--json", cwd=tmp_path)
    report = json.loads(out.read_text())
    assert json.loads(done.stdout) == report  # --json: the JSON on stdout too
    runs = {run["prefix_caching"]: run for run in report["runs"]}
    assert runs[True]["hit_rate"] == round(64 / 132, 4) and runs[False]["hit_rate"] == 0.0
    assert [runs[c]["requests"] for c in (True, False)] == [2, 2]
    assert [runs[c]["preemptions"] for c in (True, False)] == [0, 0]
    assert report["benchmark"] == "offline" and report["cpu_flags"] == cpu_flags()
    assert {"isa", "threads", "torch"} <= set(report)
    header, rule, on, off, speedup = offline.summary(report).splitlines()  # without --json
    assert re.split(r"\s{2,}", header.strip()) == offline.OFFLINE_COLUMNS
    assert set(rule) == {"-", " "}
    assert on.split()[:3] == ["shared-prefix", "on", "2"] and on.split()[-2:] == ["0.4848", "0"]
    assert off.split()[:3] == ["shared-prefix", "off", "2"] and off.split()[-2:] == ["0.0", "0"]
    ratio = report["shared-prefix_speedup_from_caching"]
    assert speedup == f"shared-prefix: {ratio}x faster with prefix caching"


@pytest.mark.slow
def test_bench_replay_is_blockserve_replay(tmp_path: Path) -> None:
    trace = write_hand_trace(tmp_path / "trace.jsonl")
    flags = ["--trace-block-size", "4", "--capacities", "4,8", "--no-progress"]
    for command, folder in ((["replay"], "plain"), (["bench", "replay"], "bench")):
        blockserve(*command, str(trace), *flags, "--out-dir", str(tmp_path / folder), cwd=tmp_path)
    plain, bench = (
        [  # each row but its wall time, which differs between any two runs
            {k: v for k, v in row.items() if k != "seconds"}
            for row in json.loads((tmp_path / folder / "replay.json").read_text())["results"]
        ]
        for folder in ("plain", "bench")
    )
    assert bench == plain and len(bench) == 2 * 9


@pytest.mark.slow
def test_bench_vs_vllm_runs_the_checkouts_race(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """Its blockserve half on a tiny model (`--dry-run`: no vLLM), through the checkout's
    benchmarks/bench_vs_vllm.py."""
    out = tmp_path / "race.json"
    race = ["--dry-run", "--model-dir", str(tiny_llama_dir), "--dtype", "float32"]
    race += ["--workload", "no-sharing", "--out", str(out)]
    blockserve("bench", "vs-vllm", *race, cwd=tmp_path)
    report = json.loads(out.read_text())
    assert list(report["workloads"]) == ["no-sharing"]
    assert report["workloads"]["no-sharing"]["blockserve"]["output_tokens"] == 2 * 32


@pytest.mark.slow
def test_bench_serve_drives_a_real_server(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """Two system prompts of 32 tokens (two whole blocks), two questions each, one client at a
    time: each group's second request finds its system prompt cached, 2 × 32 tokens."""
    server = f"--model {tiny_llama_dir} --dtype float32"
    load = ["--dataset", "shared-prefix", "--num-groups", "2", "--prompts-per-group", "2"]
    load += ["--system-len", "32", "--question-len", "8", "--output-len", "4"]
    load += ["--concurrency", "1", "--max-token-id", "300", "--out-dir", str(tmp_path / "out")]
    done = blockserve("bench", "serve", *load, "--server-args", server, cwd=tmp_path)
    path = tmp_path / "out" / "serving-shared-prefix.json"
    report = json.loads(path.read_text())
    run = report["runs"]["caching on"]
    assert (run["requests"], run["cached_tokens_reported"]) == (4, 2 * 32)
    assert len(run["ttft_samples_s"]) == 4 and report["cpu_flags"] == cpu_flags()
    header, _, row, wrote = done.stdout.splitlines()  # a table, not the JSON
    assert header.split()[:3] == ["setting", "requests", "wall"]
    assert row.split()[:3] == ["caching", "on", "4"] and row.split()[-2] == "64"
    assert wrote == f"wrote {path} and {path.with_name('serving-shared-prefix-ttft.png')}"
