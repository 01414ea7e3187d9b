"""The OpenAI fields vLLM honours, through a real server (tiny model, float32) and the openai
client, against transformers' logits: `echo` (with logprobs, streamed, and `max_tokens` 0 to
score a prompt), vLLM's `prompt_logprobs` (completions and chat), `logit_bias`, and the 400s
for what cannot be served."""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest
import torch

from blockserve.bench.server_process import ServerProcess
from tests.runner.test_model_runner import reference_logits
from tests.tiny_models import make_tokenizer

pytestmark = pytest.mark.slow  # a real server per module

PROMPT = [(5 * i + 11) % 250 + 1 for i in range(20)]
ATOL = 1e-4


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def raw_logprobs(tiny_llama_dir: Path) -> torch.Tensor:
    return reference_logits(tiny_llama_dir, PROMPT).log_softmax(dim=-1)


def prompt_token_logprobs(raw: torch.Tensor) -> list[float]:
    return [float(raw[p, PROMPT[p + 1]]) for p in range(len(PROMPT) - 1)]


def test_echo_with_logprobs(client: openai.OpenAI, raw_logprobs: torch.Tensor) -> None:
    """The prompt's text and logprobs lead the choice's (None for its first token)."""
    out = client.completions.create(
        model=None, prompt=PROMPT, max_tokens=3, temperature=0, logprobs=1, echo=True,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )  # fmt: skip
    plain = client.completions.create(
        model=None, prompt=PROMPT, max_tokens=3, temperature=0, logprobs=1,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    choice, logprobs = out.choices[0], out.choices[0].logprobs
    assert choice.text == make_tokenizer().decode(PROMPT) + plain.choices[0].text
    assert logprobs is not None and logprobs.token_logprobs is not None
    assert len(logprobs.token_logprobs) == len(PROMPT) + 3
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None  # type: ignore[index]
    echoed = logprobs.token_logprobs[1 : len(PROMPT)]
    assert echoed == pytest.approx(prompt_token_logprobs(raw_logprobs), abs=ATOL)
    assert logprobs.token_logprobs[len(PROMPT) :] == plain.choices[0].logprobs.token_logprobs  # type: ignore[union-attr]
    assert out.usage is not None and out.usage.completion_tokens == 3


def test_echo_with_zero_max_tokens_scores_the_prompt(
    client: openai.OpenAI, raw_logprobs: torch.Tensor
) -> None:
    out = client.completions.create(model=None, prompt=PROMPT, max_tokens=0, logprobs=0, echo=True)
    logprobs = out.choices[0].logprobs
    assert out.choices[0].text == make_tokenizer().decode(PROMPT)
    assert logprobs is not None and logprobs.token_logprobs is not None
    assert logprobs.token_logprobs[1:] == pytest.approx(
        prompt_token_logprobs(raw_logprobs), abs=ATOL
    )


def test_echo_streams_the_prompt_first(client: openai.OpenAI) -> None:
    chunks = list(
        client.completions.create(
            model=None,
            prompt="the quick brown",
            max_tokens=4,
            temperature=0,
            echo=True,
            stream=True,
            extra_body={"ignore_eos": True},
        )
    )
    plain = client.completions.create(
        model=None, prompt="the quick brown", max_tokens=4, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert "".join(c.choices[0].text for c in chunks) == "the quick brown" + plain.choices[0].text
    assert chunks[0].choices[0].text.startswith("the quick brown")


def test_prompt_logprobs_in_completions_and_chat(
    server: ServerProcess, raw_logprobs: torch.Tensor
) -> None:
    body = {"prompt": PROMPT, "max_tokens": 1, "prompt_logprobs": 2}
    choice = httpx.post(f"{server.url}/v1/completions", json=body).json()["choices"][0]
    positions = choice["prompt_logprobs"]
    assert len(positions) == len(PROMPT) and positions[0] is None
    for p, position in enumerate(positions[1:]):
        token, row = PROMPT[p + 1], raw_logprobs[p]
        top = row.topk(2).indices.tolist()
        assert set(position) == {str(t) for t in {token, *top}}
        assert position[str(token)]["logprob"] == pytest.approx(float(row[token]), abs=ATOL)
        assert position[str(token)]["rank"] == int((row > row[token]).sum()) + 1
        assert [position[str(t)]["rank"] for t in top] == [1, 2]
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "prompt_logprobs": 0}
    reply = httpx.post(f"{server.url}/v1/chat/completions", json=chat).json()
    assert len(reply["prompt_logprobs"]) == reply["usage"]["prompt_tokens"]


def test_logit_bias(client: openai.OpenAI, raw_logprobs: torch.Tensor) -> None:
    """+100 makes a token certain; -100 on the greedy choice leaves the second best."""
    forced = client.completions.create(
        model=None, prompt=PROMPT, max_tokens=4, temperature=0, logit_bias={"17": 100},
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )  # fmt: skip
    assert forced.choices[0].token_ids == [17] * 4  # type: ignore[attr-defined]
    best, second = raw_logprobs[-1].topk(2).indices.tolist()
    banned = client.completions.create(
        model=None, prompt=PROMPT, max_tokens=1, temperature=0, logit_bias={str(best): -100},
        extra_body={"return_token_ids": True},
    )  # fmt: skip
    assert banned.choices[0].token_ids == [second]  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        (
            {"prompt": "hi", "prompt_logprobs": 1, "stream": True},
            None,
            "prompt_logprobs are not available when stream is true",
        ),
        (
            {"prompt": "hi", "echo": True, "logprobs": 1, "stream": True},
            "echo",
            "echo with logprobs is not available when streaming",
        ),
        (
            {"prompt": "hi", "max_tokens": 0},
            "max_tokens",
            "max_tokens must be at least 1 (0 only with echo)",
        ),
        (
            {"prompt": "hi", "logit_bias": {"99999": 5}},
            "logit_bias",
            "logit_bias token id 99999 is out of range for a vocabulary of 320",
        ),
        (
            {"prompt": "hi", "prompt_logprobs": 21},
            "prompt_logprobs",
            "prompt_logprobs must be at most 20 (--max-logprobs), got 21",
        ),
    ],
)
def test_what_cannot_be_served_is_a_400(
    server: ServerProcess, body: dict, param: str | None, message: str
) -> None:
    response = httpx.post(f"{server.url}/v1/completions", json=body)
    error = response.json()["error"]
    assert response.status_code == 400
    assert message in error["message"]
    if param is not None:
        assert error["param"] == param
