"""The disk KV tier across real server processes: a second server on the same directory serves
the first one's blocks, and a server killed with SIGKILL mid-write never leaves a block that a
later one serves wrong."""

from __future__ import annotations

import contextlib
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from blockserve import LLM, SamplingParams
from blockserve.bench.server_process import ServerProcess, read_metric
from blockserve.core.hashing import BlockHasher
from tests.server.conftest import TINY_ARGS

PROMPT = [(t * 3) % 290 + 5 for t in range(80)]  # 5 full blocks, 4 hittable
PROMPTS = [[(t * 7 + k) % 300 + 10 for t in range(160)] for k in range(6)]  # 10 blocks each


def start(model: Path, kv_dir: Path, log: Path) -> ServerProcess:
    return ServerProcess(["--model", str(model), *TINY_ARGS, "--kv-cache-dir", str(kv_dir)], log)


def complete(url: str, prompt: list[int]) -> dict[str, Any]:
    body = {"prompt": prompt, "max_tokens": 4, "temperature": 0, "logprobs": 0}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return dict(response.json())


def token_logprobs(body: dict[str, Any]) -> list[float]:
    return [float(x) for x in body["choices"][0]["logprobs"]["token_logprobs"]]


@pytest.fixture(scope="module")
def reference(tiny_llama_dir: Path) -> LLM:
    """The same model computing every prompt from scratch (prefix caching off)."""
    return LLM(str(tiny_llama_dir), dtype="float32", enable_prefix_caching=False)


def recomputed(llm: LLM, prompt: list[int]) -> list[float]:
    params = SamplingParams(temperature=0.0, max_tokens=4, logprobs=0)
    (output,) = llm.generate([prompt], params, use_tqdm=False)
    assert output.outputs[0].logprobs is not None
    return [lp.logprob for lp in output.outputs[0].logprobs]


@pytest.mark.slow
def test_a_second_server_serves_the_first_ones_blocks(
    tiny_llama_dir: Path, tmp_path: Path, reference: LLM
) -> None:
    kv_dir = tmp_path / "kv"
    first = start(tiny_llama_dir, kv_dir, tmp_path / "first.log")
    cold = complete(first.url, PROMPT)
    assert first.stop() == 0, first.log()
    second = start(tiny_llama_dir, kv_dir, tmp_path / "second.log")
    try:
        warm = complete(second.url, PROMPT)
        details = warm["usage"]["prompt_tokens_details"]
        assert details == {
            "cached_tokens": 64,
            "cached_tokens_per_tier": {"device": 0, "host": 0, "disk": 64},
        }
        assert warm["choices"][0]["text"] == cold["choices"][0]["text"]
        assert token_logprobs(warm) == pytest.approx(recomputed(reference, PROMPT), abs=1e-4)
        assert read_metric(second.url, "kv_tier_hits_total") == 4
    finally:
        assert second.stop() == 0, second.log()


@pytest.mark.slow
def test_after_a_sigkill_mid_write_every_served_hit_is_right(
    tiny_llama_dir: Path, tmp_path: Path, reference: LLM
) -> None:
    """PROMPT's blocks on disk, then six prompts in flight and the server killed once their
    writes have begun; then, as a crash could also leave them, a torn temporary file and a
    truncated block. The next server drops both, serves PROMPT's blocks, and every prompt's
    logprobs match a recomputation."""
    kv_dir = tmp_path / "kv"
    first = start(tiny_llama_dir, kv_dir, tmp_path / "first.log")
    complete(first.url, PROMPT)
    wait_for_stores(first.url, 5)
    threads = [
        threading.Thread(target=_swallow, args=(complete, first.url, p), daemon=True)
        for p in PROMPTS
    ]
    for thread in threads:
        thread.start()
    wait_for_stores(first.url, 6)
    first.process.kill()
    first.process.wait()
    first.stop()
    kept = {h.hex() for h in BlockHasher("sha256").hash_new_blocks(PROMPT, [], 16)}
    others = sorted(p for p in (kv_dir / "blocks").glob("*/*.kv") if p.stem not in kept)
    assert len(others) >= 1
    torn = others[0].with_name(others[0].name + ".tmp999-0")
    torn.write_bytes(others[0].read_bytes()[:100])
    others[0].write_bytes(others[0].read_bytes()[:-7])
    second = start(tiny_llama_dir, kv_dir, tmp_path / "second.log")
    try:
        assert not torn.exists() and not others[0].exists()
        for prompt in (PROMPT, *PROMPTS):
            body = complete(second.url, prompt)
            if prompt is PROMPT:
                assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 64
            assert token_logprobs(body) == pytest.approx(recomputed(reference, prompt), abs=1e-4)
    finally:
        assert second.stop() == 0, second.log()


def wait_for_stores(url: str, count: int) -> None:
    deadline = time.monotonic() + 60
    while read_metric(url, "kv_tier_stores_total") < count:
        assert time.monotonic() < deadline, f"fewer than {count} blocks stored in 60 s"
        time.sleep(0.005)


def _swallow(fn: Any, *args: object) -> None:
    """Run `fn`, ignoring the connection error the kill causes."""
    with contextlib.suppress(httpx.HTTPError, AssertionError):
        fn(*args)
