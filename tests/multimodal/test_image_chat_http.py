"""Image chats over the OpenAI API on the test SmolVLM: an `image_url` part with a data: URL is
decoded off the event loop and placed where the chat template writes `<image>`; the answer is
the offline engine's for the same pixels, the same chat again is cached through the image,
and each kind of bad image is a 400 naming `messages` while the server keeps serving."""

from __future__ import annotations

import base64
import http.server
import io
import struct
import threading
import time
import zlib
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from PIL import Image
from prometheus_client.parser import text_string_to_metric_families

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


def chat(
    server: ServerProcess,
    url: str,
    question: str = QUESTION,
    uuid: str | None = None,
    system: str | None = None,
) -> httpx.Response:
    image = {"type": "image_url", "image_url": {"url": url}, **({"uuid": uuid} if uuid else {})}
    content = [image, {"type": "text", "text": question}]
    messages = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": content})
    return httpx.post(
        f"{server.url}/v1/chat/completions",
        json={"messages": messages, "max_tokens": 8, "temperature": 0,
              "return_cache_explanation": True},
        timeout=120,
    )  # fmt: skip


def counters(server: ServerProcess) -> dict[str, float]:
    """The image counters of /metrics, by name (this server serves one model)."""
    text = httpx.get(f"{server.url}/metrics", timeout=30).text
    names = (
        "vllm:mm_cache_queries_total",
        "vllm:mm_cache_hits_total",
        "blockserve:encoder_images_total",
    )
    return {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name in names
    }


def test_an_image_after_other_text_is_neither_processed_nor_encoded_again(
    server: ServerProcess,
) -> None:
    """The same picture under two system prompts: the prefix cache stops before it the second
    time, the processor cache and the encoder cache do not (vLLM's counters, and ours)."""
    url = data_url(png(Image.fromarray(pixels(41, 40, 70, 3))))
    before = counters(server)
    chat(server, url, system="Answer briefly.")
    second = chat(server, url, system="Answer at length.").json()
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    after = counters(server)
    assert {name: after[name] - before[name] for name in after} == {
        "vllm:mm_cache_queries_total": 2,
        "vllm:mm_cache_hits_total": 1,
        "blockserve:encoder_images_total": 1,
    }


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
    other = chat(server, data_url(png(Image.fromarray(pixels(22, 40, 70, 3))))).json()
    assert other["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # the image is in block 0
    assert other["usage"]["cache_explanation"] == {
        "first_missing_block": 0,
        "reason": "image",
        "evicted_seconds_ago": None,
    }


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
        ("http://127.0.0.1:9/cat.png", "the image's host '127.0.0.1' is not a public address"),
        ("file:///etc/hostname", "file:// image URLs need --allowed-local-media-path"),
        ("ftp://example.com/cat.png", "an image_url is a data:, http(s) or file:// URL"),
    ],
    ids=[
        "not an image",
        "truncated",
        "decompression bomb",
        "bad base64",
        "loopback url",
        "file url",
        "ftp url",
    ],
)
def test_a_bad_image_is_a_400_naming_messages(server: ServerProcess, url: str, words: str) -> None:
    refused = chat(server, url)
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert words in error["message"] and error["param"] == "messages"
    assert httpx.get(f"{server.url}/health").status_code == 200


class ImageHandler(http.server.BaseHTTPRequestHandler):
    """/cat.png: a PNG; /slow.png: the same after 3 s; anything else a 404."""

    body = b""

    def do_GET(self) -> None:  # http.server calls it by this name
        if self.path == "/slow.png":
            time.sleep(3)
        if self.path not in ("/cat.png", "/slow.png"):
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args: object) -> None:
        return


@pytest.fixture(scope="module")
def image_host() -> Iterator[str]:
    """A loopback HTTP server of images (the only address a test here may reach)."""
    ImageHandler.body = png(Image.fromarray(pixels(31, 40, 70, 3)))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), ImageHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    thread.join(timeout=10)


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("media")
    (directory / "cat.png").write_bytes(png(Image.fromarray(pixels(31, 40, 70, 3))))
    return directory


@pytest.fixture(scope="module")
def open_server(
    smolvlm_dir: Path, tmp_path_factory: pytest.TempPathFactory, media_dir: Path
) -> Iterator[ServerProcess]:
    """A server that admits 127.0.0.1 by name and reads images under `media_dir`, a fetch
    bounded at 1 s."""
    extra = ["--allowed-media-domains", "127.0.0.1", "--allowed-local-media-path", str(media_dir)]
    env = {"VLLM_IMAGE_FETCH_TIMEOUT": "1"}
    yield from tiny_server(smolvlm_dir, tmp_path_factory, extra, env=env)


def test_an_image_by_http_or_file_url_answers_as_by_its_bytes(
    open_server: ServerProcess, image_host: str, media_dir: Path
) -> None:
    """The same PNG by data:, http:// and file:// URL: the same answer, and the same image
    identifier (its bytes), so the second and third are cached through the image."""
    by_bytes = chat(open_server, data_url(ImageHandler.body)).json()
    by_http = chat(open_server, f"{image_host}/cat.png").json()
    by_file = chat(open_server, f"file://{media_dir / 'cat.png'}").json()
    answers = {r["choices"][0]["message"]["content"] for r in (by_bytes, by_http, by_file)}
    assert len(answers) == 1
    prompt_tokens = by_bytes["usage"]["prompt_tokens"]
    for later in (by_http, by_file):
        cached = later["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached == (prompt_tokens // 16) * 16


@pytest.mark.parametrize(
    ("path", "words"),
    [
        ("/slow.png", "the image URL did not answer within 1 s (VLLM_IMAGE_FETCH_TIMEOUT)"),
        ("/missing.png", "the image URL answered 404"),
    ],
)
def test_a_slow_or_missing_url_is_a_400(
    open_server: ServerProcess, image_host: str, path: str, words: str
) -> None:
    refused = chat(open_server, f"{image_host}{path}")
    assert refused.status_code == 400 and words in refused.json()["error"]["message"]


def test_hosts_and_files_outside_the_flags_are_refused(
    open_server: ServerProcess, image_host: str, tmp_path: Path
) -> None:
    outside = tmp_path / "cat.png"
    outside.write_bytes(ImageHandler.body)
    port = image_host.rsplit(":", 1)[1]
    for url, words in (
        (
            f"http://localhost:{port}/cat.png",
            "the image's host 'localhost' is not in --allowed-media-domains",
        ),
        (f"file://{outside}", "the image file is not a file under --allowed-local-media-path"),
    ):
        refused = chat(open_server, url)
        assert refused.status_code == 400 and words in refused.json()["error"]["message"]


def test_a_uuid_stands_for_the_image_in_the_cache(server: ServerProcess) -> None:
    """Two different pictures under one client uuid are one item to the cache (vLLM's rule:
    the uuid is the identifier), so the second is cached through the first's blocks; under
    two uuids, the same picture is two items."""
    first = chat(server, data_url(png(Image.fromarray(pixels(41, 40, 70, 3)))), uuid="pic-1")
    prompt_tokens = first.json()["usage"]["prompt_tokens"]
    other = chat(server, data_url(png(Image.fromarray(pixels(42, 40, 70, 3)))), uuid="pic-1")
    details = other.json()["usage"]["prompt_tokens_details"]
    assert details["cached_tokens"] == (prompt_tokens // 16) * 16
    renamed = chat(server, data_url(png(Image.fromarray(pixels(41, 40, 70, 3)))), uuid="pic-2")
    before = httpx.post(
        f"{server.url}/tokenize",
        json={"prompt": "<|im_start|>User:", "add_special_tokens": False},
    ).json()["count"]  # the chat's tokens before its image
    cached = renamed.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached == (before // 16) * 16
