"""Image chats over the OpenAI API on the test SmolVLM: an `image_url` part with a data: URL is
decoded off the event loop and placed where the chat template writes `<image>`; the answer is
the offline engine's for the same pixels, the same chat again is cached through the image,
and each kind of bad image is a 400 naming `messages` while the server keeps serving."""

from __future__ import annotations

import base64
import io
import struct
import zlib
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from PIL import Image

from blockserve import LLM, SamplingParams
from blockserve.bench.server_process import ServerProcess
from tests.multimodal.images import pixels
from tests.multimodal.smolvlm_model import save_test_smolvlm
from tests.server.conftest import tiny_server

pytestmark = pytest.mark.slow  # a SmolVLM checkpoint of SmolLM2's weights behind a real server

QUESTION = "Describe the image."


@pytest.fixture(scope="module")
def smolvlm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_test_smolvlm(tmp_path_factory.mktemp("smolvlm"))


@pytest.fixture(scope="module")
def server(smolvlm_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    yield from tiny_server(smolvlm_dir, tmp_path_factory)


def png(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    return buffer.getvalue()


def data_url(raw: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(raw).decode()


def chat(server: ServerProcess, url: str, question: str = QUESTION) -> httpx.Response:
    content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": question}]
    return httpx.post(
        f"{server.url}/v1/chat/completions",
        json={"messages": [{"role": "user", "content": content}], "max_tokens": 8,
              "temperature": 0},
        timeout=120,
    )  # fmt: skip


def test_an_image_chat_answers_as_the_offline_engine_and_is_cached_through(
    server: ServerProcess, smolvlm_dir: Path
) -> None:
    image = Image.fromarray(pixels(21, 40, 70, 3))
    first = chat(server, data_url(png(image)))
    assert first.status_code == 200, first.text
    body = first.json()
    offline = LLM(model=str(smolvlm_dir), dtype="float32")
    prompt = f"<|im_start|>User:<image>{QUESTION}<end_of_utterance>\nAssistant:"
    (out,) = offline.generate(
        {"prompt": prompt, "multi_modal_data": {"image": image}},
        SamplingParams(max_tokens=8, temperature=0),
    )
    assert body["choices"][0]["message"]["content"] == out.outputs[0].text
    assert body["usage"]["prompt_tokens"] == len(out.prompt_token_ids)
    again = chat(server, data_url(png(image))).json()
    cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached == (len(out.prompt_token_ids) // 16) * 16  # every whole block, image and all


def bomb() -> bytes:
    """A PNG header claiming 30,000 x 30,000 pixels, and nothing behind it."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (
            struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
        )

    header = struct.pack(">IIBBBBB", 30000, 30000, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IEND", b"")


@pytest.mark.parametrize(
    ("url", "words"),
    [
        (data_url(b"not an image at all"), "the image cannot be read"),
        (data_url(png(Image.fromarray(pixels(3, 40, 70, 3)))[:60]), "the image cannot be read"),
        (data_url(bomb()), "Image size (900000000 pixels) exceeds limit of 178956970 pixels"),
        ("data:image/png;base64,@@@", "the image's base64 cannot be read"),
        ("http://127.0.0.1:9/cat.png", "http(s) and file:// URLs are not served yet"),
    ],
    ids=["not an image", "truncated", "decompression bomb", "bad base64", "http url"],
)
def test_a_bad_image_is_a_400_naming_messages(server: ServerProcess, url: str, words: str) -> None:
    refused = chat(server, url)
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert words in error["message"] and error["param"] == "messages"
    assert httpx.get(f"{server.url}/health").status_code == 200
