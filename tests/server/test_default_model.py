"""The embedded default model served for real, through the openai client."""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest

from blockserve.bench.server_process import ServerProcess
from blockserve.kernels.loader import KERNELS_NOT_BUILT
from blockserve.model.weight_copies import WEIGHT_COPIES_MADE
from tests.model.test_loader import QUESTION


@pytest.mark.slow
def test_default_model_chat_mentions_paris(tmp_path: Path) -> None:
    """`blockserve serve` with no --model answers the capital of France with Paris (asked for
    the city's name: tests/model/test_loader.py says why), on our CPU kernels, which log once
    its weights are copied for them."""
    server = ServerProcess(["--max-model-len", "2048"], tmp_path / "server.log")
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        (model,) = client.models.list().data
        assert model.id == "SmolLM2-135M-Instruct"
        answer = client.chat.completions.create(
            model=model.id,
            messages=[{"role": "user", "content": QUESTION}],
            max_tokens=16,
            temperature=0,
        )
        assert "Paris" in (answer.choices[0].message.content or "")
        assert answer.choices[0].finish_reason in ("stop", "length")
        assert httpx.get(f"{server.url}/version").json()["cpu_kernels"] is True
        assert (
            server.wait_for_line((WEIGHT_COPIES_MADE, KERNELS_NOT_BUILT), timeout=120)
            == WEIGHT_COPIES_MADE
        )
    finally:
        assert server.stop() == 0, server.log()
