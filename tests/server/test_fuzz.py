"""Schemathesis, the real CLI, over every operation of a real tiny-model server: no input it
generates, valid or not, gets a 5xx, a status or content type the OpenAPI document does not
list, a body that breaks the document's schema, or acceptance of what the document rules out.

One check is left out: `positive_data_acceptance` (every schema-valid body must be accepted).
The server refuses what no schema can state: a prompt plus max_tokens past the context, token
ids past the vocabulary, a seed the generator cannot take. Those refusals are 400s, tested one
by one in test_errors.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from blockserve.bench.server_process import ServerProcess

MAX_EXAMPLES = 50  # per operation and phase; the seed makes a failure reproducible
SEED = 1


def run_schemathesis(
    url: str, report: Path, max_examples: int = MAX_EXAMPLES
) -> subprocess.CompletedProcess[str]:
    command = [
        str(Path(sys.executable).parent / "st"),
        "run",
        f"{url}/openapi.json",
        "--checks=all",
        "--exclude-checks=positive_data_acceptance",
        f"--max-examples={max_examples}",
        f"--seed={SEED}",
        "--generation-database=none",  # no .schemathesis/ left behind; the seed replays
        "--no-color",
        "--output-sanitize=false",
        "--report=json",
        f"--report-json-path={report}",
    ]
    env = {**os.environ, "SCHEMATHESIS_HOOKS": "tests.server.fuzz_hooks"}
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_schemathesis_finds_no_5xx_and_no_schema_violation(
    server: ServerProcess, tmp_path: Path
) -> None:
    """Every operation tested, no failure, no error; afterwards the pool holds no block and
    passes its integrity check (the module's fixture then checks a clean exit)."""
    report_path = tmp_path / "schemathesis.json"
    result = run_schemathesis(server.url, report_path)
    report = json.loads(report_path.read_text())
    assert (result.returncode, report["failures"], report["errors"]) == (0, [], []), result.stdout[
        -6000:
    ]
    operations = report["operations"]
    assert operations["tested"] == operations["total"] == len(report["valid_rates"]) == 10
    assert report["test_cases"]["generated"] > 10 * MAX_EXAMPLES
    kv = httpx.get(f"{server.url}/debug/kv_cache").json()
    assert (kv["num_requests_holding_blocks"], kv["integrity_errors"]) == (0, [])
