"""The client side of `blockserve bench serve`: token-id datasets (random, shared-prefix,
multi-turn), streaming requests against an OpenAI-compatible server, and their latencies."""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import statistics
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import httpx

VOCAB_LOW, VOCAB_HIGH = 100, 40000


@dataclass
class RequestResult:
    ttft: float
    itls: list[float]
    e2e: float
    prompt_tokens: int
    output_tokens: int
    cached_tokens: int
    model: str | None = None  # the model or adapter named (--lora-modules)


@dataclass
class Conversation:
    turns: list[list[int]]  # the new tokens of each user turn
    history: list[int] = field(default_factory=list)


def shared_prefix_prompts(
    args: argparse.Namespace, rng: random.Random
) -> list[tuple[int, list[int]]]:
    """(group, prompt) pairs, shuffled."""
    prompts = []
    for group in range(args.num_groups):
        system = [rng.randrange(VOCAB_LOW, args.max_token_id) for _ in range(args.system_len)]
        for _ in range(args.prompts_per_group):
            question = [
                rng.randrange(VOCAB_LOW, args.max_token_id) for _ in range(args.question_len)
            ]
            prompts.append((group, system + question))
    rng.shuffle(prompts)
    return prompts


def random_prompts(args: argparse.Namespace, rng: random.Random) -> list[tuple[int, list[int]]]:
    """(index, prompt) pairs."""
    length = args.system_len + args.question_len
    return [
        (i, [rng.randrange(VOCAB_LOW, args.max_token_id) for _ in range(length)])
        for i in range(args.num_prompts)
    ]


def model_of(args: argparse.Namespace, owner: int) -> dict:
    """The body field naming `owner`'s adapter (group, conversation or prompt index), in turn
    over `--lora-modules`; none without them (the server's model)."""
    names = getattr(args, "lora_modules", None)
    return {"model": names[owner % len(names)]} if names else {}


async def stream_chunks(
    client: httpx.AsyncClient, url: str, body: dict[str, Any]
) -> AsyncIterator[dict[str, Any]]:
    """The JSON chunks of a streamed (server-sent events) OpenAI response to `body`."""
    async with client.stream("POST", url, json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                yield json.loads(line[6:])


async def one_request(
    client: httpx.AsyncClient,
    url: str,
    prompt: list[int],
    output_len: int,
    extra: dict | None = None,
) -> tuple[RequestResult, list[int]]:
    """Stream one completion (`extra`: more body fields); returns its timings and the
    answer's token ids (multi-turn)."""
    body = {
        **(extra or {}),
        "prompt": prompt,
        "max_tokens": output_len,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
    }
    start = time.perf_counter()
    arrivals: list[float] = []
    usage: dict = {}
    answer: list[int] = []
    async for chunk in stream_chunks(client, f"{url}/v1/completions", body):
        if chunk.get("usage"):
            usage = chunk["usage"]
        if chunk["choices"] and chunk["choices"][0].get("token_ids"):
            # A token arrived (its text may still be incomplete): TTFT and ITL count tokens.
            answer += chunk["choices"][0]["token_ids"]
            arrivals.append(time.perf_counter())
    end = time.perf_counter()
    ttft = (arrivals[0] if arrivals else end) - start
    itls = [b - a for a, b in itertools.pairwise(arrivals)]
    result = RequestResult(
        ttft=ttft,
        itls=itls,
        e2e=end - start,
        prompt_tokens=usage.get("prompt_tokens", len(prompt)),
        output_tokens=usage.get("completion_tokens", 0),
        cached_tokens=usage.get("prompt_tokens_details", {}).get("cached_tokens", 0),
        model=body.get("model"),
    )
    return result, answer


async def run_load(args: argparse.Namespace, url: str) -> tuple[list[RequestResult], float]:
    """`args.dataset` against `url`: every request's result, and the wall time of them all."""
    import httpx

    rng = random.Random(args.seed)
    results: list[RequestResult] = []
    limits = httpx.Limits(max_connections=max(args.concurrency, 64))
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        start = time.perf_counter()
        if args.dataset == "multi-turn":
            await converse(client, url, args, rng, results)
        else:
            prompts = (
                shared_prefix_prompts(args, rng)
                if args.dataset == "shared-prefix"
                else random_prompts(args, rng)
            )
            await send(client, url, prompts, args, rng, results)
        return results, time.perf_counter() - start


async def converse(
    client: httpx.AsyncClient,
    url: str,
    args: argparse.Namespace,
    rng: random.Random,
    results: list[RequestResult],
) -> None:
    """`--num-prompts` conversations of `--turns` turns, each resending its history so far;
    at most `--concurrency` requests in flight."""
    conversations = [
        Conversation(
            [
                [rng.randrange(VOCAB_LOW, args.max_token_id) for _ in range(args.question_len)]
                for _ in range(args.turns)
            ]
        )
        for _ in range(args.num_prompts)
    ]
    semaphore = asyncio.Semaphore(args.concurrency)

    async def one(index: int, conversation: Conversation) -> None:
        for turn in conversation.turns:
            conversation.history += turn
            async with semaphore:
                result, answer = await one_request(
                    client, url, conversation.history, args.output_len, model_of(args, index)
                )
            results.append(result)
            conversation.history += answer

    await asyncio.gather(*(one(i, c) for i, c in enumerate(conversations)))


async def send(
    client: httpx.AsyncClient,
    url: str,
    prompts: list[tuple[int, list[int]]],
    args: argparse.Namespace,
    rng: random.Random,
    results: list[RequestResult],
) -> None:
    """Every (owner, prompt): Poisson arrivals at `--request-rate`, else `--concurrency`
    clients."""
    if args.request_rate:
        tasks = []
        for owner, prompt in prompts:
            request = one_request(client, url, prompt, args.output_len, model_of(args, owner))
            tasks.append(asyncio.create_task(request))
            await asyncio.sleep(rng.expovariate(args.request_rate))
        results.extend(r for r, _ in await asyncio.gather(*tasks))
        return
    queue: asyncio.Queue[tuple[int, list[int]]] = asyncio.Queue()
    for item in prompts:
        queue.put_nowait(item)

    async def worker() -> None:
        while not queue.empty():
            owner, prompt = queue.get_nowait()
            result, _ = await one_request(
                client, url, prompt, args.output_len, model_of(args, owner)
            )
            results.append(result)

    await asyncio.gather(*(worker() for _ in range(args.concurrency)))


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    ordered = sorted(values)

    def pick(q: float) -> float:
        return round(ordered[min(int(q * len(ordered)), len(ordered) - 1)] * 1e3, 1)

    return {
        "mean_ms": round(statistics.mean(values) * 1e3, 1),
        "p50_ms": pick(0.5),
        "p90_ms": pick(0.9),
        "p99_ms": pick(0.99),
    }


def summarize(results: list[RequestResult], wall: float, hit_rate: float | None) -> dict:
    tpots = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in results if r.output_tokens > 1]
    output_tokens = sum(r.output_tokens for r in results)
    return {
        "requests": len(results),
        "wall_s": round(wall, 2),
        "request_throughput_per_s": round(len(results) / wall, 3),
        "output_tokens_per_s": round(output_tokens / wall, 1),
        "total_tokens_per_s": round(
            (output_tokens + sum(r.prompt_tokens for r in results)) / wall, 1
        ),
        "ttft": percentiles([r.ttft for r in results]),
        "tpot": percentiles(tpots),
        "itl": percentiles([x for r in results for x in r.itls]),
        "e2e": percentiles([r.e2e for r in results]),
        "cached_tokens_reported": sum(r.cached_tokens for r in results),
        **_per_model_hits(results),
        "server_prefix_cache_hit_rate": hit_rate,
        "ttft_samples_s": [round(r.ttft, 4) for r in results],
    }


def _per_model_hits(results: list[RequestResult]) -> dict:
    """With --lora-modules: each adapter's share of its prompt tokens found cached."""
    models = sorted({r.model for r in results if r.model is not None})
    if not models:
        return {}
    shares = {}
    for model in models:
        mine = [r for r in results if r.model == model]
        prompt = sum(r.prompt_tokens for r in mine)
        shares[model] = round(sum(r.cached_tokens for r in mine) / prompt, 4) if prompt else None
    return {"cached_share_per_model": shares}
