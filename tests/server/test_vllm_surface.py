"""vLLM's flags and routes that blockserve lacks say what they are: one line for a flag, a
404 naming the served routes for a route; the lists match the peer vLLM where it is built."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from blockserve.cli import build_parser, main
from blockserve.server.errors import install_error_handlers
from blockserve.server.vllm_surface import VLLM_ONLY_FLAGS, is_vllm_route, unsupported_flag

PEER_PYTHON = Path(__file__).resolve().parents[2] / ".peer" / "bin" / "python"
# vLLM's serve parser, as `vllm serve` builds it (the peer's own code).
VLLM_FLAGS = """
from vllm.entrypoints.launchers.cli_args import make_arg_parser
from vllm.utils.argparse_utils import FlexibleArgumentParser
parser = make_arg_parser(FlexibleArgumentParser())
print(" ".join(o for a in parser._actions for o in a.option_strings if o.startswith("--")))
"""


def serve_flags() -> set[str]:
    (serve,) = (
        action.choices["serve"] for action in build_parser()._actions if action.choices
    )  # the subcommands' action
    return {o for a in serve._actions for o in a.option_strings if o.startswith("--")}


@pytest.mark.parametrize(
    ("flag", "message"),
    [
        (
            "--speculative-config",
            "--speculative-config is a vLLM option blockserve does not support yet",
        ),
        (
            "--kv-cache-dtype=fp8",
            "--kv-cache-dtype is a vLLM option blockserve does not "
            "support yet (the KV cache is kept in --dtype)",
        ),
        ("--quantization", None),  # ours: gguf
        ("--max-num-seqs", None),  # ours
        ("--made-up", None),  # nobody's
    ],
)
def test_a_vllm_flag_is_named_as_one(flag: str, message: str | None) -> None:
    assert unsupported_flag(flag) == message


def test_no_flag_is_both_ours_and_listed_as_vllms_alone() -> None:
    assert serve_flags() & VLLM_ONLY_FLAGS == set()


def test_serve_refuses_a_vllm_flag_in_one_line_with_its_usage(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["serve", "--enable-sleep-mode"])
    err = capsys.readouterr().err
    assert exited.value.code == 2
    assert err.startswith("usage: blockserve serve ")
    assert err.splitlines()[-1] == (
        "blockserve serve: error: --enable-sleep-mode is a vLLM option blockserve does not "
        "support yet"
    )


@pytest.mark.slow
@pytest.mark.skipif(not PEER_PYTHON.exists(), reason="the peer vLLM is built by make peer-vllm")
def test_the_list_is_vllms_flags_less_ours() -> None:
    """Every flag of `vllm serve` (less its --no- forms) is ours or in the list, and the list
    holds nothing else."""
    printed = subprocess.run(
        [str(PEER_PYTHON), "-c", VLLM_FLAGS], capture_output=True, text=True, timeout=300
    )
    assert printed.returncode == 0, printed.stderr[-2000:]
    vllm = {f for f in printed.stdout.split() if not f.startswith("--no-")}
    assert vllm - serve_flags() == VLLM_ONLY_FLAGS


def test_a_missing_route_names_the_served_ones() -> None:
    """A vLLM route is named as one; any other missing route as no route; both list the
    routes served, method and path."""
    app = FastAPI()
    install_error_handlers(app)

    @app.get("/health")
    async def health() -> None:
        return None

    @app.post("/v1/completions")
    async def completions() -> None:
        return None

    client = TestClient(app)
    embeddings = client.post("/v1/embeddings", json={})
    assert embeddings.status_code == 404
    assert embeddings.json()["error"] == {
        "message": "POST /v1/embeddings is a vLLM route blockserve does not serve; this server "
        "serves GET /health, POST /v1/completions",
        "type": "NotFoundError",
        "param": None,
        "code": 404,
    }
    other = client.get("/v1/nothing").json()["error"]["message"]
    assert (
        other == "GET /v1/nothing is no route; this server serves GET /health, POST /v1/completions"
    )
    assert client.get("/v1/completions").status_code == 405  # a route, another method


@pytest.mark.parametrize(
    ("path", "vllms"),
    [
        ("/v1/responses/resp_1/cancel", True),
        ("/v1/responses", True),
        ("/v1/responses/a/b", False),
        ("/v1/embeddings/", True),
        ("/v1/models", False),
    ],
)
def test_vllm_routes_match_with_their_parameters(path: str, vllms: bool) -> None:
    assert is_vllm_route(path) is vllms
