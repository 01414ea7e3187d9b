"""`blockserve serve --replicas 2` on a real local Ray instance: two tiny-model replicas behind
the KV-aware router, driven through the OpenAI client, each serving a LoRA adapter too. One
cluster for the whole module (Ray takes ~30 s to start)."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from blockserve.bench.server_process import ServerProcess

pytestmark = pytest.mark.slow
BLOCK_SIZE = 4
REPLICA_TITLE = "ServeReplica:blockserve:EngineReplica"


def replica_pids() -> list[int]:
    """The engine replicas' processes (Ray titles them by deployment)."""
    lines = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout
    return [int(line.split()[0]) for line in lines.splitlines() if REPLICA_TITLE in line]


@pytest.fixture(scope="module")
def cluster(
    tiny_llama_dir: Path, adapters: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    log_path = tmp_path_factory.mktemp("ray-cluster") / "serve.log"
    args = ["--model", str(tiny_llama_dir), "--dtype", "float32", "--block-size", str(BLOCK_SIZE)]
    args += [
        "--enable-lora",
        "--max-lora-rank",
        "8",
        "--lora-modules",
        f"every={adapters['every']}",
    ]
    server = ServerProcess([*args, "--replicas", "2", "--router", "kv"], log_path)
    # /health answers once the ingress and one replica run.
    assert server.wait_for_cluster(replicas=2, timeout=120), server.log()
    assert len(replica_pids()) == 2, server.log()
    yield server
    assert server.stop(timeout=90) == 0, server.log()
    assert replica_pids() == []  # nothing left behind: Serve and the local Ray are shut down


@pytest.fixture
def client(cluster: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="unused", max_retries=0)


def tokens(cluster: ServerProcess, prompt: str) -> list[int]:
    return httpx.post(f"{cluster.url}/tokenize", json={"prompt": prompt}).json()["tokens"]


def expected_hit(previous: list[int], current: list[int]) -> int:
    """Tokens an engine that ran `previous` serves `current` from cache: their common full
    blocks, the last prompt token always computed."""
    common = 0
    for a, b in zip(previous, current, strict=False):
        if a != b:
            break
        common += 1
    return min(common, len(current) - 1) // BLOCK_SIZE * BLOCK_SIZE


def test_each_prefix_group_returns_to_the_replica_that_computed_it(
    cluster: ServerProcess, client: openai.OpenAI
) -> None:
    """Two prefix groups in an order round robin would mix (A B B A A B B A): every repeat is
    served from its group's cached prefix — which only the replica that computed it holds —
    and each group has a replica of its own."""
    model = client.models.list().data[0].id
    prefixes = {
        "A": "the quick brown fox jumps over the lazy dog. " * 4,
        "B": "what is the capital of france? paris is the capital of france. " * 3,
    }
    seen: dict[str, list[int]] = {}
    sent: dict[str, list[list[int]]] = {"A": [], "B": []}
    # Each turn: the group, the router's view of each replica before it routed the request,
    # and the replica that served it (for the message should the split below fail).
    routed: list[tuple[str, dict, str]] = []
    for turn, group in enumerate("ABBAABBA"):
        prompt = f"{prefixes[group]}hello {turn}"
        before = httpx.get(f"{cluster.url}/cluster/replicas").json()
        completion = client.completions.create(
            model=model, prompt=prompt, max_tokens=2, temperature=0
        )
        after = httpx.get(f"{cluster.url}/cluster/replicas").json()["replicas"]
        served = [
            rid
            for rid, r in after.items()
            if r["num_requests"] > before["replicas"].get(rid, {}).get("num_requests", 0)
        ]
        routed.append((group, before["router"], ",".join(served)))
        details = completion.usage.prompt_tokens_details
        cached = details.cached_tokens if details is not None else 0
        current = tokens(cluster, prompt)
        expected = expected_hit(seen[group], current) if group in seen else 0
        assert (turn, cached) == (turn, expected)
        seen[group] = current
        sent[group].append(current)
    assert expected_hit(tokens(cluster, prefixes["A"]), tokens(cluster, prefixes["B"])) == 0
    # B's first request had no overlap anywhere: it went to the emptier replica.
    report = httpx.get(f"{cluster.url}/cluster/replicas").json()["replicas"]
    assert sorted(r["num_requests"] for r in report.values()) == [4, 4], routed
    # The router follows each replica's KV events: its index of the replica that served a
    # group holds that group's full prompt blocks, plus at most one block per request that
    # the first generated token completed. It heard every request end: nothing is queued.
    holder = {
        group: next(rid for rid, r in report.items() if r["prompt_tokens"] == sum(map(len, p)))
        for group, p in sent.items()
    }
    expected = {group: distinct_blocks(p) for group, p in sent.items()}
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        router = httpx.get(f"{cluster.url}/cluster/replicas").json()["router"]
        indexed = {group: router[rid]["indexed_blocks"] for group, rid in holder.items()}
        queued = [entry["queued_blocks"] for entry in router.values()]
        if all(indexed[g] >= expected[g] for g in sent) and queued == [0, 0]:
            break
        time.sleep(0.2)
    assert all(router[rid]["kv_events"] for rid in holder.values())
    assert queued == [0, 0], router
    assert all(expected[g] <= indexed[g] <= expected[g] + 4 for g in sent), (indexed, expected)


def test_replicas_serve_the_adapter_and_the_router_keeps_it_apart(
    cluster: ServerProcess, client: openai.OpenAI, tiny_llama_dir: Path, adapters: dict[str, Path]
) -> None:
    """The ingress lists the replicas' adapter; a prompt under it gives peft's tokens, is sent
    again to the replica that cached it under that adapter (the router hashes with the
    adapter's name), and hits nothing under the base model, which caches it apart."""
    from tests.lora.test_lora import PROMPTS, reference

    base, listed = (m.model_dump() for m in client.models.list().data)
    assert (listed["id"], listed["parent"]) == ("every", base["id"])
    served_by, hits = [], []
    for model in ("every", "every", base["id"], base["id"]):
        before = httpx.get(f"{cluster.url}/cluster/replicas").json()["replicas"]
        out = client.completions.create(
            model=model, prompt=PROMPTS[1], max_tokens=8, temperature=0,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )  # fmt: skip
        after = httpx.get(f"{cluster.url}/cluster/replicas").json()["replicas"]
        counts = {rid: before.get(rid, {}).get("num_requests", 0) for rid in after}
        served_by += [rid for rid, r in after.items() if r["num_requests"] > counts[rid]]
        details = out.usage.prompt_tokens_details if out.usage is not None else None
        hits.append(details.cached_tokens if details is not None else 0)
        adapter = adapters["every"] if model == "every" else None
        assert out.choices[0].token_ids == reference(tiny_llama_dir, adapter, PROMPTS[1])[0]  # type: ignore[attr-defined]
    assert hits == [0, 44, 0, 44]  # 45 tokens: 11 whole blocks of 4, the last token computed
    assert served_by[0] == served_by[1] and served_by[2] == served_by[3]
    response = httpx.post(
        f"{cluster.url}/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/"}
    )
    assert response.status_code == 404  # off without --allow-runtime-lora-updating


def distinct_blocks(prompts: list[list[int]]) -> int:
    """Full blocks of `prompts` with their chains of parents, each counted once."""
    chains = {tuple(p[:end]) for p in prompts for end in range(BLOCK_SIZE, len(p) + 1, BLOCK_SIZE)}
    return len(chains)


def stream_one(client: openai.OpenAI, model: str, index: int) -> str:
    """Stream a long completion; "ok", or the error message the stream ended with."""
    try:
        stream = client.completions.create(
            model=model,
            prompt=f"hello world {index} " * 5,
            max_tokens=200,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        for _ in stream:
            pass
    except openai.APIError as exc:
        return exc.message
    return "ok"


def test_a_killed_replica_fails_its_streams_cleanly_and_is_replaced(
    cluster: ServerProcess, client: openai.OpenAI
) -> None:
    """SIGKILL one replica under load: its streams end with an OpenAI-shaped error, the
    others finish; new requests succeed at once (sent again if they reached the dead one);
    Ray Serve starts a new replica."""
    model = client.models.list().data[0].id
    victim = replica_pids()[0]
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        streams = [pool.submit(stream_one, client, model, i) for i in range(6)]
        time.sleep(1.0)
        os.kill(victim, signal.SIGKILL)
        outcomes = [f.result(timeout=120) for f in streams]
    assert set(outcomes) <= {"ok", "the replica serving this request died"}
    assert "ok" in outcomes
    assert [stream_one(client, model, 100 + i) for i in range(4)] == ["ok"] * 4
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline and len(replica_pids()) < 2:
        time.sleep(1.0)
    pids = replica_pids()
    assert len(pids) == 2 and victim not in pids
    assert stream_one(client, model, 200) == "ok"
