"""The README's commands work after `make serve` alone: run here in a process that cannot import
what only the extras install (dev, cluster, plots: matplotlib, pytest, ray, openai, ...), as a
new user's environment would be."""

from __future__ import annotations

import importlib.metadata as metadata
import json
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Iterable
from pathlib import Path

import httpx
import pytest
from packaging.requirements import Requirement

from blockserve.bench.server_process import ServerProcess, free_port
from tests.multimodal.smolvlm_model import HUB_ID, save_test_smolvlm_hub

pytestmark = pytest.mark.slow  # a trace replay and a real server with the embedded model

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
README = (ROOT / "README.md").read_text()
EXTRAS = ("dev", "cluster", "plots")

# Imported first by every process started with this directory on PYTHONPATH: a module only
# the extras install reads as not installed.
BLOCKER = """
import sys

for name in {blocked!r}:
    sys.modules[name] = None  # `import` fails, `importlib.util.find_spec` answers None
"""


def _closure(requirements: Iterable[Requirement]) -> set[str]:
    """The distributions `requirements` install, with theirs (markers read without extras)."""
    seen: set[str] = set()
    stack = list(requirements)
    while stack:
        requirement = stack.pop()
        name = requirement.name.lower().replace("_", "-")
        if name in seen or name == "blockserve":
            continue
        try:
            distribution = metadata.distribution(requirement.name)
        except metadata.PackageNotFoundError:
            continue
        seen.add(name)
        for text in distribution.requires or ():
            nested = Requirement(text)
            if nested.marker is None or nested.marker.evaluate({"extra": ""}):
                stack.append(nested)
    return seen


def extras_only_modules() -> set[str]:
    """Top-level modules whose every distribution the extras alone install."""
    declared = [Requirement(text) for text in metadata.distribution("blockserve").requires or ()]
    runtime = _closure(r for r in declared if r.marker is None or r.marker.evaluate({"extra": ""}))
    extras = _closure(
        Requirement(str(r).split(";")[0])
        for r in declared
        if r.marker is not None and any(r.marker.evaluate({"extra": e}) for e in EXTRAS)
    )
    only = extras - runtime
    return {
        module
        for module, owners in metadata.packages_distributions().items()
        if all(owner.lower().replace("_", "-") in only for owner in owners)
    }


@pytest.fixture(scope="module")
def runtime_only(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    blocked = extras_only_modules()
    assert {"matplotlib", "pytest", "ray", "openai"} <= blocked and "torch" not in blocked
    site = tmp_path_factory.mktemp("runtime-only")
    (site / "sitecustomize.py").write_text(BLOCKER.format(blocked=sorted(blocked)))
    return {"PATH": f"{BIN}:/usr/bin:/bin", "PYTHONPATH": str(site), "HOME": str(Path.home())}


def readme_commands() -> list[str]:
    """The `.venv/bin/blockserve ...` lines of the README's shell blocks (continuations
    joined, comments dropped)."""
    commands = []
    for block in re.findall(r"```sh\n(.*?)```", README, re.DOTALL):
        for command in block.replace("\\\n", " ").splitlines():
            command = command.split("  #")[0].strip()
            if command.startswith(".venv/bin/blockserve"):
                commands.append(" ".join(command.split()))
    return commands


def run(command: str, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", "-c", command], capture_output=True, text=True, cwd=ROOT, env=env, timeout=timeout
    )


def test_the_extras_cannot_be_imported_there(runtime_only: dict[str, str]) -> None:
    probe = (
        "import blockserve.cli, torch\ntry:\n import matplotlib\nexcept ImportError: print('no')"
    )
    done = run(f'{BIN}/python -c "{probe}"', runtime_only, 120)
    assert (done.returncode, done.stdout) == (0, "no\n"), done.stderr


def test_the_readme_lists_the_commands_this_file_runs() -> None:
    events = "--endpoint tcp://127.0.0.1:5557 --json"
    assert readme_commands() == [
        ".venv/bin/blockserve serve --enable-lora --max-lora-rank 8 --lora-modules "
        "capitals=adapters/capitals",
        ".venv/bin/blockserve serve HuggingFaceTB/SmolVLM-256M-Instruct "
        '--allowed-local-media-path "$PWD/docs/images"',
        ".venv/bin/blockserve serve --help",
        '.venv/bin/blockserve serve --kv-events-config \'{"enable_kv_cache_events": true, '
        '"publisher": "zmq", "endpoint": "tcp://*:5557"}\'',
        f".venv/bin/blockserve events {events}",
        ".venv/bin/blockserve replay benchmarks/data/mooncake_synthetic_trace.jsonl",
        ".venv/bin/blockserve replay benchmarks/data/mooncake_synthetic_trace.jsonl "
        "--replicas 1,4,16,64",
    ]


def test_serve_help_and_the_replays(runtime_only: dict[str, str], tmp_path: Path) -> None:
    """The help, and both replays (run side by side) to their tables and files, the plot named
    as needing the `plots` extra, not a crash."""
    help_command, *_ = (c for c in readme_commands() if c.endswith("--help"))
    done = run(help_command, runtime_only, 120)
    assert done.returncode == 0 and done.stdout.startswith("usage: blockserve serve")
    replays = {
        command: subprocess.Popen(
            ["bash", "-c", f"{command} --out-dir {tmp_path / 'out'} --no-progress"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
            env=runtime_only,
        )
        for command in readme_commands()
        if " replay " in command
    }
    for command, process in replays.items():
        out, err = process.communicate(timeout=600)
        assert process.returncode == 0, err[-3000:]
        wrote = out.splitlines()[-1]
        if "--replicas" in command:
            assert wrote == f"wrote {tmp_path / 'out' / 'replay_cluster.json'}"
        else:
            assert wrote == (
                f"wrote {tmp_path / 'out' / 'replay.json'} (the plot needs matplotlib: "
                ".venv/bin/pip install 'blockserve[plots]')"
            )


def test_a_server_publishes_what_the_events_command_prints(
    runtime_only: dict[str, str], tmp_path: Path
) -> None:
    """The README's event-publishing server (the embedded model; on a free port and event
    port here) and its `events` command: one request's blocks arrive as JSON lines."""
    serve, events = (c for c in readme_commands() if "kv-events-config" in c or " events " in c)
    port = free_port()
    serve_args = serve.removeprefix(".venv/bin/blockserve serve ").replace("5557", str(port))
    server = ServerProcess(
        ["--dtype", "float32", *shlex.split(serve_args)], tmp_path / "server.log", env=runtime_only
    )
    try:
        watch = subprocess.Popen(
            ["bash", "-c", events.replace("5557", str(port)) + " --max-events 1"],
            stdout=subprocess.PIPE,
            text=True,
            cwd=ROOT,
            env=runtime_only,
        )
        time.sleep(1.0)  # the subscriber connects (a PUB drops what no subscriber holds)
        httpx.post(
            f"{server.url}/v1/completions",
            json={"prompt": list(range(100, 140)), "max_tokens": 1},
            timeout=120,
        ).raise_for_status()
        out, _ = watch.communicate(timeout=60)
    finally:
        server.stop()
    assert watch.returncode == 0 and '"BlockStored"' in out


def test_the_image_chat_is_cached_through_the_picture(
    runtime_only: dict[str, str], tmp_path: Path
) -> None:
    """The README's image chat: its server, on the test SmolVLM cached under the hub id it
    names (no hub is reachable here), and its curl command twice: nothing cached the first
    time, every block before the last token's the second, the picture's included."""
    serve = next(c for c in readme_commands() if HUB_ID in c)
    (curl,) = (
        b
        for b in re.findall(r"```sh\n(.*?)```", README, re.DOTALL)
        if "curl" in b and "image_url" in b
    )
    env = {
        **runtime_only,
        "HF_HUB_CACHE": str(save_test_smolvlm_hub(tmp_path)),
        "HF_HUB_OFFLINE": "1",
    }
    args = shlex.split(serve.removeprefix(".venv/bin/blockserve serve ").replace("$PWD", str(ROOT)))
    server = ServerProcess(["--dtype", "float32", *args], tmp_path / "server.log", env=env)
    try:
        answers = [
            json.loads(
                run(
                    curl.replace("localhost:8000", server.url.removeprefix("http://")), env, 120
                ).stdout
            )
            for _ in range(2)
        ]
    finally:
        server.stop()
    assert answers[0]["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    usage = answers[1]["usage"]
    assert usage["prompt_tokens"] == answers[0]["usage"]["prompt_tokens"] > 64
    whole_blocks = (usage["prompt_tokens"] - 1) // 16 * 16  # the last token is always computed
    assert usage["prompt_tokens_details"]["cached_tokens"] == whole_blocks
