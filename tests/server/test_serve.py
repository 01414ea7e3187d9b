"""`blockserve serve` as a process: what it logs at start, and a clean exit on SIGTERM."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from tests.server.conftest import TINY_ARGS
from tests.server.server_process import ServerProcess


def test_start_up_log_and_sigterm_exit(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """The log names the model, the cache and the address; SIGTERM ends with code 0."""
    server = ServerProcess(["--model", str(tiny_llama_dir), *TINY_ARGS], tmp_path / "log")
    try:
        server.process.send_signal(signal.SIGTERM)
        assert server.process.wait(30) == 0
    finally:
        server.stop()
    log = server.log()
    assert f"model {tiny_llama_dir.name} ({tiny_llama_dir}, dtype float32), context 512" in log
    assert "KV cache: 256 blocks of 16 tokens = 4096 tokens; prefix caching on (sha256)" in log
    assert f"listening on http://127.0.0.1:{server.port}" in log
    assert "stopped" in log


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--max-num-seqs", "0"], "max_num_seqs (--max-num-seqs) must be positive, got 0"),
        (["--device", "tpu"], "device (--device) must be auto, cpu, cuda or cuda:N, got 'tpu'"),
    ],
)
def test_a_bad_engine_flag_exits_2_before_loading(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """A bad value is reported with its flag and the exit code is 2; no model is loaded."""
    from blockserve.cli import main

    assert main(["serve", "--model", "/nonexistent", *flags]) == 2
    assert capsys.readouterr().err == f"blockserve serve: {message}\n"
