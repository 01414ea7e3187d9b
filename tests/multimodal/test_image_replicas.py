"""Image chats on `blockserve serve --replicas 2 --router kv` (a real local Ray instance): the
ingress decodes and identifies each picture and hashes the prompt with it, so the turns about
one picture return to the replica that holds its blocks, in an order round robin would mix."""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator

import httpx
import pytest
from PIL import Image

from blockserve.bench.server_process import ServerProcess
from tests.multimodal.images import pixels
from tests.multimodal.smolvlm_model import save_test_smolvlm

pytestmark = pytest.mark.slow  # Ray starts in ~30 s; two replicas of SmolLM2's 135M weights


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    model = save_test_smolvlm(tmp_path_factory.mktemp("smolvlm"))
    log_path = tmp_path_factory.mktemp("ray-images") / "serve.log"
    args = ["--model", str(model), "--dtype", "float32", "--replicas", "2", "--router", "kv"]
    server = ServerProcess(args, log_path)
    assert server.wait_for_cluster(replicas=2, timeout=180), server.log()
    yield server
    assert server.stop(timeout=90) == 0, server.log()


def picture_url(seed: int) -> str:
    buffer = io.BytesIO()
    Image.fromarray(pixels(seed, 40, 70, 3)).save(buffer, "PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def test_each_picture_returns_to_the_replica_that_holds_it(cluster: ServerProcess) -> None:
    """A B B A: each repeat is served from its picture's cached blocks (every block before the
    last token's), which only the replica that computed them holds."""
    urls = {"A": picture_url(51), "B": picture_url(52)}
    usages = []
    for picture in "ABBA":
        content = [
            {"type": "image_url", "image_url": {"url": urls[picture]}},
            {"type": "text", "text": "Describe the image."},
        ]
        answer = httpx.post(
            f"{cluster.url}/v1/chat/completions",
            json={"messages": [{"role": "user", "content": content}], "max_tokens": 2},
            timeout=120,
        )
        assert answer.status_code == 200, answer.text
        usages.append(answer.json()["usage"])
    cached = [u["prompt_tokens_details"]["cached_tokens"] for u in usages]
    whole_blocks = [(u["prompt_tokens"] - 1) // 16 * 16 for u in usages]
    assert cached == [0, 0, whole_blocks[2], whole_blocks[3]]
    report = httpx.get(f"{cluster.url}/cluster/replicas").json()["replicas"]
    assert sorted(r["num_requests"] for r in report.values()) == [2, 2]
