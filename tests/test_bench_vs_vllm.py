"""benchmarks/bench_vs_vllm.py cannot rot: its --dry-run drives the blockserve half (an offline
engine in a worker process, a real `blockserve serve` under the chat load) on a tiny model."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_dry_run_races_the_blockserve_half_offline_and_served(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "vs_vllm.json"
    command = [sys.executable, "benchmarks/bench_vs_vllm.py", "--dry-run"]
    command += ["--model-dir", str(tiny_llama_dir), "--dtype", "float32"]
    command += ["--workload", "shared-prefix", "serving", "--rates", "4", "--repeats", "2"]
    command += ["--out", str(out)]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(out.read_text())
    assert results["thread_mode"] == "bound"  # beside the host stamp's thread count
    workloads = results["workloads"]

    offline = workloads["shared-prefix"]
    assert set(offline) == {"blockserve"}  # no vLLM half, so no ratio
    assert offline["blockserve"]["output_tokens"] == 4 * 32
    assert offline["blockserve"]["dtype"] == "float32"
    assert offline["blockserve"]["peak_rss_mb"] > 100  # a worker that imported torch and ran
    runs = offline["blockserve"]["wall_s_runs"]  # --repeats 2: the median run's is one of them
    assert len(runs) == 2 and offline["blockserve"]["wall_s"] == min(runs)

    serving = workloads["serving"]
    assert serving["load"]["rates_per_s"] == [4.0]
    # The tiny model's head dimension is not our kernels': no weight copies to wait for.
    assert serving["blockserve"]["copies_ready_s"] is None
    run = serving["blockserve"]["rates"]["4"]
    assert run["requests"] == 2 * 2  # 2 chats × 2 turns
    assert run["answer_tokens"] == 2 * 2 * 4
    # Each second turn resends its first turn's 40 prompt tokens: 2 full blocks are cached.
    assert run["cached_tokens_reported"] >= 2 * 32


@pytest.mark.slow
def test_dry_run_serves_the_image_chat_load(tmp_path: Path) -> None:
    """The image-chat half on the tiny test SmolVLM: 2 chats x 2 turns over the chat API;
    each second turn resends its picture and is served from the first turn's blocks."""
    from tests.multimodal.smolvlm_model import save_test_smolvlm

    model = save_test_smolvlm(tmp_path / "smolvlm")
    out = tmp_path / "vs_vllm.json"
    command = [sys.executable, "benchmarks/bench_vs_vllm.py", "--dry-run"]
    command += ["--model-dir", str(model), "--dtype", "float32"]
    command += ["--workload", "image-chat", "--out", str(out)]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    chats = json.loads(out.read_text())["workloads"]["image-chat"]
    assert set(chats) == {"load", "model_dir", "blockserve"}
    (run,) = chats["blockserve"]["rates"].values()
    assert run["requests"] == 2 * 2
    assert run["cached_tokens_reported"] >= 2 * 80  # the picture's blocks, and the text's before


@pytest.mark.slow
def test_dry_run_races_one_stream_on_the_default_model(tmp_path: Path) -> None:
    """blockserve's one-stream engines (dense, and --quantization gguf where the host runs its
    kernel), 8 greedy tokens each from the same prompt ids, no llama.cpp half."""
    import torch

    from blockserve.kernels.build import can_build

    out = tmp_path / "vs_vllm.json"
    command = [sys.executable, "benchmarks/bench_vs_vllm.py", "--dry-run"]
    command += ["--workload", "one-stream", "--out", str(out)]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    race = json.loads(out.read_text())["workloads"]["one-stream"]
    engines = {"blockserve", "blockserve-gguf"} if can_build(torch.bfloat16) else {"blockserve"}
    assert set(race) == {"prompt_tokens", "output_tokens"} | engines
    assert race["output_tokens"] == 8
    for engine in engines:
        assert len(race[engine]["tokens"]) == 8
        assert race[engine]["decode_tokens_per_s"] > 0
        assert "vs_llama_cpp" not in race[engine]
