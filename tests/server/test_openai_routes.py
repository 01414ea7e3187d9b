"""/v1/completions and /v1/chat/completions through the official openai client, against a real
server process (tiny model): streaming, n, logprobs, stops, token ids, batched prompts."""

from __future__ import annotations

import json

import openai
import pytest

from blockserve.bench.server_process import ServerProcess
from tests.tiny_models import make_tokenizer

PROMPT_33 = list(range(10, 43))


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


@pytest.mark.slow
def test_completion(client: openai.OpenAI) -> None:
    """A greedy completion returns max_tokens tokens with usage, cached tokens included."""
    out = client.completions.create(
        model=None,  # type: ignore[arg-type]
        prompt="the quick brown",
        max_tokens=6,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert out.object == "text_completion"
    assert out.choices[0].finish_reason == "length"
    assert out.usage is not None and out.usage.completion_tokens == 6
    assert out.usage.prompt_tokens_details is not None
    assert out.usage.prompt_tokens_details.cached_tokens == 0


def test_chat_completion(client: openai.OpenAI) -> None:
    """Chat renders the template; the answer is the assistant message."""
    out = client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=[{"role": "user", "content": "hello"}],
        max_tokens=5,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert out.choices[0].message.role == "assistant"
    expected_prompt = make_tokenizer().encode(
        "<|user|>hello<eos><|assistant|>", add_special_tokens=False
    )
    assert out.usage is not None
    assert out.usage.prompt_tokens == len(expected_prompt)
    assert out.usage.completion_tokens == 5


def test_streaming_with_usage_equals_non_streaming(client: openai.OpenAI) -> None:
    """Streamed deltas concatenate to the non-streamed text; usage comes in a final chunk."""
    kwargs = dict(
        prompt="hello world", max_tokens=10, temperature=0, extra_body={"ignore_eos": True}
    )
    whole = client.completions.create(model=None, **kwargs).choices[0].text  # type: ignore[arg-type]
    chunks = list(
        client.completions.create(
            model=None,
            stream=True,
            stream_options={"include_usage": True},
            **kwargs,  # type: ignore[arg-type]
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 10
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_chat_streaming(client: openai.OpenAI) -> None:
    """The chat stream opens with the role and ends with a finish reason."""
    chunks = list(
        client.chat.completions.create(
            model=client.models.list().data[0].id,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=4,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason == "length"


def test_n_two_choices(client: openai.OpenAI) -> None:
    """n=2 returns choices 0 and 1; with a seed the request is reproducible."""
    kwargs = dict(
        prompt=PROMPT_33,
        max_tokens=8,
        n=2,
        temperature=1.0,
        seed=11,
        extra_body={"ignore_eos": True},
    )
    first = client.completions.create(model=None, **kwargs)  # type: ignore[arg-type]
    again = client.completions.create(model=None, **kwargs)  # type: ignore[arg-type]
    assert [c.index for c in first.choices] == [0, 1]
    assert [c.text for c in first.choices] == [c.text for c in again.choices]
    assert first.usage is not None and first.usage.completion_tokens == 16


def test_logprobs(client: openai.OpenAI) -> None:
    """Completion logprobs: one entry per token with top-2 alternatives; chat logprobs too."""
    out = client.completions.create(
        model=None,
        prompt="hello",
        max_tokens=3,
        temperature=0,
        logprobs=2,  # type: ignore[arg-type]
        extra_body={"ignore_eos": True},
    )
    logprobs = out.choices[0].logprobs
    assert logprobs is not None and logprobs.token_logprobs is not None
    assert len(logprobs.token_logprobs) == 3 and all(lp <= 0 for lp in logprobs.token_logprobs)
    assert logprobs.top_logprobs is not None and all(len(t) <= 2 for t in logprobs.top_logprobs)
    chat = client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=3,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True},
    )
    content = chat.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == 3
    assert all(len(entry.top_logprobs) == 2 for entry in content)


def test_stop_sequence(client: openai.OpenAI) -> None:
    """A stop sequence from the greedy text ends it there with finish_reason "stop"."""
    kwargs = dict(prompt="the quick", max_tokens=20, temperature=0, extra_body={"ignore_eos": True})
    text = client.completions.create(model=None, **kwargs).choices[0].text  # type: ignore[arg-type]
    stop = text[4:7]
    cut = text[: text.find(stop)]
    out = client.completions.create(model=None, stop=[stop], **kwargs)  # type: ignore[arg-type]
    assert out.choices[0].text == cut
    assert out.choices[0].finish_reason == "stop"


def test_return_token_ids(server: ServerProcess) -> None:
    """return_token_ids adds each choice's token ids, whole or per streamed chunk."""
    import httpx

    body = {
        "prompt": "hello",
        "max_tokens": 5,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    whole = httpx.post(f"{server.url}/v1/completions", json=body).json()
    token_ids = whole["choices"][0]["token_ids"]
    assert len(token_ids) == whole["usage"]["completion_tokens"] == 5
    streamed: list[int] = []
    with httpx.stream("POST", f"{server.url}/v1/completions", json={**body, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                streamed += json.loads(line[6:])["choices"][0]["token_ids"]
    assert streamed == token_ids


def test_batched_prompts(server: ServerProcess) -> None:
    """A list of prompts gives one choice per prompt, in order; a bad one refuses the batch."""
    import httpx

    body = {
        "prompt": ["hello", "the quick brown"],
        "max_tokens": 3,
        "temperature": 0,
        "ignore_eos": True,
    }
    out = httpx.post(f"{server.url}/v1/completions", json=body).json()
    assert [c["index"] for c in out["choices"]] == [0, 1]
    assert out["usage"]["completion_tokens"] == 6
    single = httpx.post(f"{server.url}/v1/completions", json={**body, "prompt": "the quick brown"})
    assert out["choices"][1]["text"] == single.json()["choices"][0]["text"]
    bad = httpx.post(f"{server.url}/v1/completions", json={**body, "prompt": ["hi", [99999]]})
    assert bad.status_code == 400
    assert httpx.get(f"{server.url}/debug/kv_cache").json()["num_requests_holding_blocks"] == 0


def test_cache_explanation_in_usage(client: openai.OpenAI) -> None:
    """return_cache_explanation: usage says where the match stopped and why, through the
    official client's extra fields; a streamed usage chunk carries it too; a list of prompts
    gets one per prompt; without the field there is none."""
    prompt = list(range(200, 240))  # 40 tokens: 2 full blocks of 16 and a partial one

    def usage(**extra: object) -> dict:
        body = {"return_cache_explanation": True, **extra}
        out = client.completions.create(model=None, prompt=prompt, max_tokens=1, extra_body=body)  # type: ignore[arg-type]
        assert out.usage is not None
        return out.usage.model_dump()

    first = usage()
    assert first["cache_explanation"] == {
        "first_missing_block": 0,
        "reason": "never_stored",
        "evicted_seconds_ago": None,
    }
    assert usage()["cache_explanation"]["reason"] == "partial_block"
    salted = usage(cache_salt="other")["cache_explanation"]
    assert (salted["first_missing_block"], salted["reason"]) == (0, "never_stored")
    chunks = list(
        client.completions.create(
            model=None,  # type: ignore[arg-type]
            prompt=prompt,
            max_tokens=1,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"return_cache_explanation": True},
        )
    )
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.model_dump()["cache_explanation"]["first_missing_block"] == 2
    batch = client.completions.create(
        model=None,  # type: ignore[arg-type]
        prompt=[prompt, list(range(250, 270))],
        max_tokens=1,
        extra_body={"return_cache_explanation": True},
    )
    assert batch.usage is not None
    assert [e["reason"] for e in batch.usage.model_dump()["cache_explanation"]] == [
        "partial_block",
        "never_stored",
    ]
    plain = client.completions.create(model=None, prompt=prompt, max_tokens=1)  # type: ignore[arg-type]
    assert plain.usage is not None and "cache_explanation" not in plain.usage.model_dump()


def test_chat_cache_explanation(client: openai.OpenAI) -> None:
    """Chat takes the field too: a repeated conversation stops at its partial last block or
    at the last-token rule, never below block 1."""
    kwargs = dict(
        model=client.models.list().data[0].id,
        messages=[{"role": "user", "content": "explain the cache " * 6}],
        max_tokens=1,
        extra_body={"return_cache_explanation": True},
    )
    client.chat.completions.create(**kwargs)  # type: ignore[call-overload]
    again = client.chat.completions.create(**kwargs)  # type: ignore[call-overload]
    explanation = again.usage.model_dump()["cache_explanation"]
    assert explanation["reason"] in ("partial_block", "last_token")
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert explanation["first_missing_block"] == cached // 16 >= 1


@pytest.mark.slow
def test_metrics_count_finished_stopped_and_aborted_requests(server: ServerProcess) -> None:
    """request_success counts choices by finish reason, aborts included; TTFT and e2e count
    prompts (e2e only those served to the end). Hand-counted over: a probe (length), an n=2
    request (2 x length), a request stopped by its first token (stop), and a stream whose
    client leaves after the first chunk (abort)."""
    import time

    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    def counts() -> dict[str, float]:
        families = text_string_to_metric_families(httpx.get(f"{server.url}/metrics").text)
        values: dict[str, float] = {}
        for sample in (s for family in families for s in family.samples):
            if sample.name == "blockserve:request_success_total":
                values[sample.labels["finished_reason"]] = sample.value
            elif sample.name == "blockserve:time_to_first_token_seconds_count":
                values["ttft"] = sample.value
            elif sample.name == "blockserve:e2e_request_latency_seconds_count":
                values["e2e"] = sample.value
        return values

    url = f"{server.url}/v1/completions"
    body = {"prompt": PROMPT_33, "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    before = counts()
    probe = httpx.post(url, json={**body, "return_token_ids": True}).json()
    stop_id = probe["choices"][0]["token_ids"][0]
    assert httpx.post(url, json={**body, "n": 2, "temperature": 1.0, "seed": 3}).status_code == 200
    stopped = httpx.post(url, json={**body, "stop_token_ids": [stop_id]}).json()
    assert stopped["choices"][0]["finish_reason"] == "stop"
    with httpx.stream("POST", url, json={**body, "max_tokens": 400, "stream": True}) as r:
        next(r.iter_lines())  # the first chunk, then hang up
    after = counts()
    for _ in range(100):  # the server notices the departure within a poll or two
        if after.get("abort", 0) > before.get("abort", 0):
            break
        time.sleep(0.05)
        after = counts()
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    assert (delta["length"], delta["stop"], delta["abort"]) == (3, 1, 1)
    assert (delta["ttft"], delta["e2e"]) == (4, 3)  # every prompt with a token; not the abort
