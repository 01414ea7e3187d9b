"""Hostile requests against a real `blockserve serve` (the default model, float32): what each
costs an innocent neighbour, whether a shared request_id leaks output, and whether a cache
explanation tells a tenant anything of another's prompt.

hostile       an innocent stream (150 tokens) alone, then beside each hostile request of the
              adversarial round (grammars and schemas that crashed or stalled the server,
              100,000 choices, 500,000 stop strings with n 64, 10,000 prompts, n 128 and n 64
              with max_tokens 4,000, 650,000 emoji, 200 connections that send nothing): the
              hostile request's status and seconds, the innocent stream's largest gap between
              chunks over its gap alone, its time to first token, and any 5xx
id-race       a stream under request_id "same" hangs up after one chunk, another client sends
              "same" at once: how many of N answers carry text not their own
explain-guess --cache-salt-per-key with two keys: tenant A sends a prompt; tenant B asks for a
              cache explanation of A's first block (a right guess) and of a wrong one
adapters-and-scoring  the second round, on a server with runtime LoRA loading and
              --stream-write-timeout 5: an adapter unloaded under four 7,000-token requests,
              adapters whose tensors lie (rank 24 under r 8; a header claiming 256 MiB),
              prompt logprobs with n 8 on 1,500 tokens, echo + logprobs 5 + n 4 on 7,800
              tokens, n 128 scoring an 8,000-token prompt, 50 streams whose clients read
              nothing: each one's answers, the innocent stream's gap over its gap alone, and
              whether the engine is still up

  .venv/bin/python benchmarks/bench_hostile.py --out benchmarks/results/hostile/hostile.json
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import socket
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.report import run_sections
from blockserve.bench.server_process import ServerProcess, metric_sum
from tests.hostile_inputs import lark_chain, ref_chain

SERVER_ARGS = ["--dtype", "float32"]
INNOCENT = {"prompt": "Once upon a time", "max_tokens": 150, "ignore_eos": True, "stream": True}


def hostile_bodies() -> dict[str, tuple[str, dict[str, Any]]]:
    """name -> (route, body) of each hostile request of the adversarial round."""
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 16}
    tool = {"type": "function", "function": {"name": "f", "parameters": ref_chain(1000)}}
    schema = {"type": "json_schema", "json_schema": {"name": "r", "schema": ref_chain(1000)}}
    return {
        "lark grammar, 3,000 rules": (
            "completions",
            {"prompt": "hi", "structured_outputs": {"grammar": lark_chain(3000)}},
        ),
        "json_schema, $ref chain 1,000 deep": (
            "chat/completions",
            {**chat, "response_format": schema},
        ),
        "named tool, $ref chain 1,000 deep": (
            "chat/completions",
            {
                **chat,
                "tools": [tool],
                "tool_choice": {"type": "function", "function": {"name": "f"}},
            },
        ),
        "choice, 100,000 entries": (
            "completions",
            {"prompt": "hi", "structured_outputs": {"choice": [f"c{i}" for i in range(100_000)]}},
        ),
        "500,000 stop strings, n 64": (
            "completions",
            {"prompt": "hi", "n": 64, "max_tokens": 16, "stop": [f"s{i}" for i in range(500_000)]},
        ),
        "10,000 prompts": (
            "completions",
            {"prompt": [[i % 300, 7] for i in range(10_000)], "max_tokens": 4},
        ),
        "n 128, max_tokens 4,000": ("completions", {"prompt": "hi", "n": 128, "max_tokens": 4000}),
        "n 64, max_tokens 4,000": ("completions", {"prompt": "hi", "n": 64, "max_tokens": 4000}),
        "650,000 emoji": ("completions", {"prompt": "\N{GRINNING FACE}" * 650_000}),
    }


def innocent_stream(url: str) -> dict[str, float]:
    """The innocent stream's time to first token and its largest gap between chunks."""
    start = time.perf_counter()
    times = []
    with httpx.stream("POST", f"{url}/v1/completions", json=INNOCENT, timeout=600) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                times.append(time.perf_counter())
    gaps = [b - a for a, b in itertools.pairwise(times)]
    return {"ttft_s": round(times[0] - start, 3), "max_gap_s": round(max(gaps), 3)}


def send_hostile(url: str, route: str, body: dict[str, Any], limit_s: float) -> dict[str, Any]:
    """The hostile request, given up after `limit_s` (a long one keeps running until then)."""
    start = time.perf_counter()
    try:
        response = httpx.post(f"{url}/v1/{route}", json=body, timeout=limit_s)
        status: int | str = response.status_code
        message = response.json().get("error", {}).get("message", "")[:160]
    except httpx.TimeoutException:
        status, message = "running at the limit", ""
    return {"status": status, "seconds": round(time.perf_counter() - start, 2), "message": message}


def idle_connections(url: str, count: int, hold_s: float) -> dict[str, Any]:
    """`count` connections that send nothing: how many the server closed within `hold_s`."""
    host, port = url.removeprefix("http://").split(":")
    sockets = [socket.create_connection((host, int(port))) for _ in range(count)]
    deadline = time.monotonic() + hold_s
    closed = 0
    for sock in sockets:
        sock.settimeout(max(0.01, deadline - time.monotonic()))
        with contextlib.suppress(TimeoutError):
            closed += sock.recv(1) == b""
        sock.close()
    return {"status": f"{closed} of {count} closed", "seconds": hold_s, "message": ""}


def hostile(out_dir: Path) -> dict[str, Any]:
    cases: dict[str, Any] = hostile_bodies()
    cases["200 connections sending nothing, 15 s"] = lambda url: idle_connections(url, 200, 15.0)
    return beside_innocent(ServerProcess(SERVER_ARGS, out_dir / "hostile.log"), cases, 120.0)


def beside_innocent(server: ServerProcess, cases: dict[str, Any], limit_s: float) -> dict[str, Any]:
    """The innocent stream alone (3 times), then beside each case: a (route, body) sent with
    `limit_s`, or a callable of the server's URL. Stops the server."""
    try:
        alone = [innocent_stream(server.url) for _ in range(3)]
        idle_gap = sorted(r["max_gap_s"] for r in alone)[1]
        results: dict[str, Any] = {"innocent_alone": alone, "idle_max_gap_s": idle_gap}
        for name, case in cases.items():
            with ThreadPoolExecutor(1) as pool:
                if callable(case):
                    attack = pool.submit(case, server.url)
                else:
                    attack = pool.submit(send_hostile, server.url, *case, limit_s)
                time.sleep(0.2)  # the hostile request first, the innocent beside it
                innocent = innocent_stream(server.url)
                outcome = attack.result()
            alive = httpx.get(f"{server.url}/health", timeout=10).status_code == 200
            results[name] = {
                **outcome,
                "innocent": innocent,
                "gap_over_idle": round(innocent["max_gap_s"] / idle_gap, 2),
                "server_alive": alive,
            }
            print(json.dumps({name: results[name]}), flush=True)
        statuses = [r["status"] for r in results.values() if isinstance(r, dict) and "status" in r]
        results["num_5xx"] = sum(isinstance(s, int) and s >= 500 for s in statuses)
        results["exit_code"] = server.stop()
        return results
    finally:
        if server.process.poll() is None:
            server.stop()


def id_race(out_dir: Path, races: int = 1000) -> dict[str, Any]:
    server = ServerProcess(SERVER_ARGS, out_dir / "id-race.log")
    try:
        url = server.url
        mine = {"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}
        expected = httpx.post(f"{url}/v1/completions", json=mine, timeout=60).json()
        theirs = {"prompt": "Tell me a story", "max_tokens": 64, "stream": True}
        foreign = 0
        with httpx.Client(timeout=60) as client:
            for _ in range(races):
                body = {**theirs, "request_id": "same"}
                with client.stream("POST", f"{url}/v1/completions", json=body) as stream:
                    next(line for line in stream.iter_lines() if line.startswith("data: "))
                answer = client.post(
                    f"{url}/v1/completions", json={**mine, "request_id": "same"}
                ).json()
                text = answer["choices"][0]["text"]
                foreign += text != expected["choices"][0]["text"]
        return {"races": races, "foreign_text": foreign}
    finally:
        server.stop()


def explain_guess(out_dir: Path) -> dict[str, Any]:
    args = [*SERVER_ARGS, "--api-key", "ka", "--api-key", "kb", "--cache-salt-per-key"]
    server = ServerProcess(args, out_dir / "explain-guess.log")
    try:
        secret = list(range(1000, 1040))  # tenant A's prompt: 2 full blocks and a partial one

        def ask(key: str, prompt: list[int]) -> dict[str, Any]:
            body = {"prompt": prompt, "max_tokens": 1, "return_cache_explanation": True}
            response = httpx.post(
                f"{server.url}/v1/completions",
                json=body,
                headers={"Authorization": f"Bearer {key}"},
                timeout=60,
            ).json()
            return {
                "cached_tokens": (response["usage"].get("prompt_tokens_details") or {}).get(
                    "cached_tokens", 0
                ),
                "explanation": response["usage"]["cache_explanation"],
            }

        ask("ka", secret)
        right = ask("kb", secret[:17])
        wrong = ask("kb", [7, *secret[1:17]])
        return {"right_guess": right, "wrong_guess": wrong, "answers_differ": right != wrong}
    finally:
        server.stop()


ROUND_TWO_ARGS = [*SERVER_ARGS, "--enable-lora", "--max-lora-rank", "8",
                  "--allow-runtime-lora-updating", "--stream-write-timeout", "5"]  # fmt: skip
ADAPTER = Path(__file__).resolve().parent.parent / "adapters" / "capitals"


def lying_adapter(out_dir: Path, case: str) -> Path:
    """The shipped adapter with layer 0's v_proj at rank 24 under r 8, or a header that
    declares q_proj's A [1048576, 576] over a sparse file of that size."""
    import shutil
    import struct

    import torch
    from safetensors.torch import load_file, save_file

    path = out_dir / f"adapter-{case}"
    shutil.rmtree(path, ignore_errors=True)
    shutil.copytree(ADAPTER, path)
    weights = path / "adapter_model.safetensors"
    tensors = load_file(str(weights))
    if case == "rank-24":
        for key in [k for k in tensors if "layers.0.self_attn.v_proj" in k]:
            a, b = tensors[key].shape
            tensors[key] = torch.ones(24, b) if "lora_A" in key else torch.ones(a, 24)
        save_file(tensors, str(weights))
        return path
    header, offset = {}, 0
    for key in sorted(tensors):
        shape = list(tensors[key].shape)
        if "layers.0.self_attn.q_proj.lora_A" in key:
            shape = [1 << 20, shape[1]]
        size = 4 * shape[0] * shape[1]
        header[key] = {"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    weights.write_bytes(struct.pack("<Q", len(raw)) + raw)
    os.truncate(weights, 8 + len(raw) + offset)
    return path


def unload_race(url: str) -> dict[str, Any]:
    """Load an adapter, four 7,000-token requests under it and its unload at once."""
    load = {"lora_name": "racer", "lora_path": str(ADAPTER)}
    httpx.post(f"{url}/v1/load_lora_adapter", json=load, timeout=60).raise_for_status()
    prompt = [(7 * i + 11) % 40000 + 100 for i in range(7000)]
    body = {"model": "racer", "prompt": prompt, "max_tokens": 4}
    with ThreadPoolExecutor(5) as pool:
        asks = [pool.submit(httpx.post, f"{url}/v1/completions", json=body, timeout=300)
                for _ in range(4)]  # fmt: skip
        time.sleep(0.05)
        unload = pool.submit(httpx.post, f"{url}/v1/unload_lora_adapter",
                             json={"lora_name": "racer"}, timeout=60)  # fmt: skip
        statuses = [a.result().status_code for a in asks]
    status = f"requests {statuses}, unload {unload.result().status_code}"
    if unload.result().status_code != 200:  # refused while they ran: unload it now
        httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "racer"}, timeout=60)
    return {"status": status, "seconds": 0.0, "message": ""}


def lying_load(url: str, path: Path) -> dict[str, Any]:
    start = time.perf_counter()
    load = {"lora_name": "liar", "lora_path": str(path)}
    response = httpx.post(f"{url}/v1/load_lora_adapter", json=load, timeout=120)
    message = response.json().get("error", {}).get("message", "")[:200]
    seconds = round(time.perf_counter() - start, 2)
    return {"status": response.status_code, "seconds": seconds, "message": message}


def stalled_readers(url: str, count: int, limit_s: float) -> dict[str, Any]:
    """`count` streams of 2,000 tokens with 20 logprobs each whose clients read nothing: how
    many the server aborted (its write timeout), and when the last was, within `limit_s`."""
    host, port = url.removeprefix("http://").split(":")
    body = json.dumps({"prompt": "Once upon a time", "stream": True, "max_tokens": 2000,
                       "logprobs": 20, "ignore_eos": True}).encode()  # fmt: skip
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
            f"\r\nContent-Length: {len(body)}\r\n\r\n").encode()  # fmt: skip
    before = aborted(url)
    start = time.perf_counter()
    sockets = []
    for _ in range(count):
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect((host, int(port)))
        sock.sendall(head + body)
        sockets.append(sock)
    while aborted(url) - before < count and time.perf_counter() - start < limit_s:
        time.sleep(0.5)
    done = aborted(url) - before
    seconds = round(time.perf_counter() - start, 1)
    for sock in sockets:
        sock.close()
    return {"status": f"{done:.0f} of {count} aborted", "seconds": seconds, "message": ""}


def aborted(url: str) -> float:
    """Choices the server ended as aborted so far (vLLM's request_success_total)."""
    return metric_sum(url, "vllm:request_success_total", finished_reason="abort")


def round_two_cases(out_dir: Path) -> dict[str, Any]:
    """name -> a callable of the server's URL, or (route, body)."""
    scored = [(13 * i + 5) % 40000 + 100 for i in range(8000)]
    return {
        "adapter unloaded under four 7,000-token requests": unload_race,
        "adapter with v_proj at rank 24 under r 8": lambda url: lying_load(
            url, lying_adapter(out_dir, "rank-24")
        ),
        "adapter header claiming 256 MiB (sparse file)": lambda url: lying_load(
            url, lying_adapter(out_dir, "sparse")
        ),
        "prompt_logprobs 5, n 8, 1,500 tokens": (
            "completions",
            {"prompt": scored[:1500], "n": 8, "max_tokens": 1, "prompt_logprobs": 5},
        ),
        "echo + logprobs 5, n 4, 7,800 tokens": (
            "completions",
            {"prompt": scored[:7800], "n": 4, "max_tokens": 1, "echo": True, "logprobs": 5},
        ),
        "n 128 scoring 8,000 tokens": (
            "completions",
            {"prompt": scored, "n": 128, "max_tokens": 1, "prompt_logprobs": 1},
        ),
        "50 streams whose clients read nothing": lambda url: stalled_readers(url, 50, 300.0),
    }


def adapters_and_scoring(out_dir: Path) -> dict[str, Any]:
    server = ServerProcess(ROUND_TWO_ARGS, out_dir / "adapters-and-scoring.log")
    results = beside_innocent(server, round_two_cases(out_dir), 300.0)
    return {"server_args": ROUND_TWO_ARGS, **results}


SECTIONS = {
    "hostile": hostile,
    "id-race": id_race,
    "explain-guess": explain_guess,
    "adapters-and-scoring": adapters_and_scoring,
}


def main() -> None:
    run_sections(__doc__, SECTIONS, "hostile", SERVER_ARGS)


if __name__ == "__main__":
    main()
