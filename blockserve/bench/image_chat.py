"""The image-chat load: conversations about one picture each (a PNG sent as a data: URL in the
first turn, then text questions), every turn resending the conversation so far, streamed over
/v1/chat/completions; chats arrive as a Poisson process. The pictures come from a formula, so
two runs (and two servers) get the same bytes."""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import itertools
import random
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
from PIL import Image

from blockserve.bench.load import RequestResult, stream_chunks

if TYPE_CHECKING:
    import httpx

QUESTIONS = (
    "What is in this image?",
    "What colours does it have?",
    "Describe its top left corner.",
    "Is it a photograph or a drawing?",
    "What would you call it?",
    "Summarise what you said.",
)


@dataclass(frozen=True)
class ImageChatLoad:
    chats: int = 16  # one picture each
    turns: int = 4
    answer_len: int = 16
    rate: float = 0.1  # chats per second (Poisson arrivals)
    size: tuple[int, int] = (480, 640)  # each picture's height and width
    seed: int = 0


def picture_url(seed: int, height: int, width: int) -> str:
    """A PNG, as a data: URL, of gradients that differ by `seed`."""
    y, x, c = np.indices((height, width, 3))
    pixels = ((x * (3 + seed % 7) + y * (5 + seed % 11) + c * 80 + seed * 37) % 256).astype(
        np.uint8
    )
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, "PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


async def chat_request(
    client: httpx.AsyncClient, url: str, messages: list[dict[str, Any]], output_len: int
) -> tuple[RequestResult, str]:
    """Stream one greedy chat completion of `output_len` tokens; its timings and its text."""
    body = {
        "messages": messages,
        "max_tokens": output_len,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    arrivals: list[float] = []
    usage: dict[str, Any] = {}
    text: list[str] = []
    async for chunk in stream_chunks(client, f"{url}/v1/chat/completions", body):
        if chunk.get("usage"):
            usage = chunk["usage"]
        if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
            text.append(chunk["choices"][0]["delta"]["content"])
            arrivals.append(time.perf_counter())
    end = time.perf_counter()
    result = RequestResult(
        ttft=(arrivals[0] if arrivals else end) - start,
        itls=[b - a for a, b in itertools.pairwise(arrivals)],
        e2e=end - start,
        prompt_tokens=usage.get("prompt_tokens", 0),
        output_tokens=usage.get("completion_tokens", 0),
        cached_tokens=(usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
    )
    return result, "".join(text)


async def run_image_chats(
    url: str, load: ImageChatLoad
) -> tuple[list[RequestResult], list[str], float]:
    """Every turn's timings, every answer (chat by chat, turn by turn) and the wall time."""
    import httpx

    rng = random.Random(load.seed)
    gaps = [0.0] + [rng.expovariate(load.rate) for _ in range(load.chats - 1)]
    urls = [picture_url(load.seed * 1000 + chat, *load.size) for chat in range(load.chats)]
    results: list[RequestResult] = []
    limits = httpx.Limits(max_connections=load.chats + 4)
    async with httpx.AsyncClient(timeout=1800, limits=limits) as client:

        async def converse(start_after: float, image_url: str) -> list[str]:
            await asyncio.sleep(start_after)
            first = [
                {"type": "image_url", "image_url": {"url": image_url}},
                {"type": "text", "text": QUESTIONS[0]},
            ]
            messages: list[dict[str, Any]] = [{"role": "user", "content": first}]
            answers = []
            for turn in range(load.turns):
                if turn:
                    question = QUESTIONS[turn % len(QUESTIONS)]
                    messages.append({"role": "user", "content": question})
                result, answer = await chat_request(client, url, messages, load.answer_len)
                results.append(result)
                answers.append(answer)
                messages.append({"role": "assistant", "content": answer})
            return answers

        started = time.perf_counter()
        chats = await asyncio.gather(
            *(converse(at, u) for at, u in zip(itertools.accumulate(gaps), urls, strict=True))
        )
        wall = time.perf_counter() - started
    return results, [a for chat in chats for a in chat], wall


async def run_load(args: argparse.Namespace, url: str) -> tuple[list[RequestResult], float]:
    """`blockserve bench serve --dataset image-chat`: --num-prompts chats of --turns turns,
    --output-len tokens an answer, at --request-rate chats/s (default 0.1)."""
    load = ImageChatLoad(
        chats=args.num_prompts,
        turns=args.turns,
        answer_len=args.output_len,
        rate=args.request_rate or ImageChatLoad.rate,
        seed=args.seed,
    )
    results, _, wall = await run_image_chats(url, load)
    return results, wall
