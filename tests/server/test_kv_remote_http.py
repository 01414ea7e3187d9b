"""The remote KV tier across real server processes and a real Redis server: replica B serves
the prefix replica A computed from the shared store (tokens and logprobs of a fresh
computation), and a store that pauses, stops and restarts mid-load costs hits, never an
answer."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from blockserve import LLM
from blockserve.bench.redis_server import RedisServer
from blockserve.bench.server_process import ServerProcess
from tests.server.conftest import TINY_ARGS
from tests.server.test_kv_tiers_http import (  # noqa: F401
    PROMPT,
    PROMPTS,
    complete,
    recomputed,
    reference,
    token_logprobs,
)


def start(model: Path, url: str, log: Path, *flags: str) -> ServerProcess:
    return ServerProcess(["--model", str(model), *TINY_ARGS, "--kv-remote-url", url, *flags], log)


def remote_metric(url: str, name: str) -> float:
    """`blockserve:kv_tier_<name>` of the remote tier."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics").text
    return next(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == f"blockserve:kv_tier_{name}" and sample.labels.get("tier") == "remote"
    )


def wait_for_keys(server: RedisServer, count: int) -> None:
    """Until the store holds `count` keys (the writer thread puts them after the step)."""
    client = server.client()
    deadline = time.monotonic() + 60
    while client.dbsize() < count:
        assert time.monotonic() < deadline, f"fewer than {count} blocks in the store in 60 s"
        time.sleep(0.01)


@pytest.mark.slow
def test_replica_b_serves_the_prefix_replica_a_computed(
    tiny_llama_dir: Path,
    tmp_path: Path,
    redis_server: RedisServer,
    reference: LLM,  # noqa: F811
) -> None:
    a = start(tiny_llama_dir, redis_server.url, tmp_path / "a.log")
    b = start(tiny_llama_dir, redis_server.url, tmp_path / "b.log")
    try:
        cold = complete(a.url, PROMPT)
        wait_for_keys(redis_server, 5)  # the prompt's 5 full blocks
        warm = complete(b.url, PROMPT)
        assert warm["usage"]["prompt_tokens_details"] == {
            "cached_tokens": 64,
            "cached_tokens_per_tier": {"device": 0, "host": 0, "disk": 0, "remote": 64},
        }
        assert warm["choices"][0]["text"] == cold["choices"][0]["text"]
        assert token_logprobs(warm) == pytest.approx(recomputed(reference, PROMPT), abs=1e-4)
        assert [remote_metric(b.url, n) for n in ("hits_total", "failures_total")] == [4, 0]
        assert remote_metric(a.url, "stores_total") >= 5
    finally:
        assert a.stop() == 0, a.log()
        assert b.stop() == 0, b.log()


@pytest.mark.slow
def test_with_a_shared_secret_a_forged_store_changes_no_answer(
    tiny_llama_dir: Path,
    tmp_path: Path,
    redis_server: RedisServer,
    reference: LLM,  # noqa: F811
) -> None:
    """Both replicas sign with --kv-remote-secret; someone without it rewrites every block A
    wrote (a fresh checksum over other bytes). B reads none of them: 0 remote tokens, each
    record counted corrupt and deleted, its answer a fresh computation's."""
    flags = ("--kv-remote-secret", "s3cret")
    a = start(tiny_llama_dir, redis_server.url, tmp_path / "a.log", *flags)
    b = start(tiny_llama_dir, redis_server.url, tmp_path / "b.log", *flags)
    try:
        cold = complete(a.url, PROMPT)
        wait_for_keys(redis_server, 5)
        client = redis_server.client()
        for key in client.keys("blockserve:*"):
            client.set(key, forged(client.get(key)))  # type: ignore[arg-type]
        warm = complete(b.url, PROMPT)
        assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert warm["choices"][0]["text"] == cold["choices"][0]["text"]
        assert token_logprobs(warm) == pytest.approx(recomputed(reference, PROMPT), abs=1e-4)
        assert remote_metric(b.url, "corrupt_total") >= 1
        assert remote_metric(b.url, "hits_total") == 0
    finally:
        assert a.stop() == 0, a.log()
        assert b.stop() == 0, b.log()


def forged(value: bytes) -> bytes:
    """A signed record's block bytes changed, its checksum made good, its signature kept."""
    from blockserve.kv_tiers.remote import TAG_BYTES
    from blockserve.kv_tiers.store import RECORD_HEADER, pack_block

    payload = bytearray(value[RECORD_HEADER.size : -TAG_BYTES])
    payload[: len(payload) // 2] = bytes(len(payload) // 2)
    return pack_block(bytes(payload)) + value[-TAG_BYTES:]


@pytest.mark.slow
def test_a_store_paused_or_stopped_mid_load_changes_no_answer(
    tiny_llama_dir: Path,
    tmp_path: Path,
    redis_server: RedisServer,
    reference: LLM,  # noqa: F811
) -> None:
    server = start(tiny_llama_dir, redis_server.url, tmp_path / "server.log")
    try:
        changes = {1: redis_server.pause, 2: redis_server.resume, 3: redis_server.stop,
                   5: redis_server.start}  # fmt: skip
        for index, prompt in enumerate(PROMPTS):
            if index in changes:
                changes[index]()
            body = complete(server.url, prompt)
            assert token_logprobs(body) == pytest.approx(recomputed(reference, prompt), abs=1e-4)
        assert "KV remote tier" in server.log() and "is down" in server.log()
        assert remote_metric(server.url, "failures_total") >= 1
    finally:
        assert server.stop() == 0, server.log()
