"""KV tiers below the device on this CPU: what a disk hit saves, in TTFT, on the default model.

Sections (each builds its own engines; the model is the embedded SmolLM2-135M-Instruct):
  restore    One --prefix-tokens prompt (+1 token) computed from scratch, then asked again after
             the device cache is reset, so its blocks come from the disk tier: with the files
             in the page cache (warm) and after evicting them from it (cold, posix_fadvise
             DONTNEED). TTFT of each, median over --repeats distinct prompts.
  multiturn  --conversations chats of --turns turns each, visited round-robin, on a device
             cache that holds about two of them: every turn re-sends the whole history plus
             --turn-tokens new tokens. p50/p90 TTFT of the turns after the first, without
             tiers and with the disk tier.
  restart    A --prefix-tokens prompt served by an engine that is then shut down; a second
             engine on the same directory serves it again (warm restart) and a third one on
             an empty directory (cold start). TTFT of each, median over --repeats.
  offload    Step time while every step writes fresh blocks down (--batch distinct prompts of
             --prefix-tokens, decoding --decode-tokens each), with tiers off and with the disk
             tier: median and p90 step time, and the blocks written.
  shared     Two replicas (engines) on one Redis store on loopback (--kv-remote-url): a
             --prefix-tokens prompt (+1) computed on A, then asked of B, whose device cache
             never saw it; against B computing another such prompt. TTFT of each, median over
             --repeats.

    .venv/bin/python benchmarks/bench_tiers.py [--section restore multiturn restart offload
        shared]
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from report import emit

from blockserve import LLM, SamplingParams
from blockserve.engine.outputs import RequestOutput
from blockserve.engine.request import RequestSpec

ONE_TOKEN = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)


def random_prompt(seed: int, length: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(1000, 40000, (length,), generator=generator).tolist()


def ttft(output: RequestOutput) -> float:
    metrics = output.metrics
    assert metrics.first_token_time is not None
    return metrics.first_token_time - metrics.arrival_time


def serve(llm: LLM, prompt: list[int], params: SamplingParams = ONE_TOKEN) -> RequestOutput:
    (output,) = llm.generate([prompt], params, use_tqdm=False)
    return output


@contextmanager
def directory() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="bench-tiers-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def drop_page_cache(root: Path) -> int:
    """Drop the block files from the page cache (no root needed): write back their dirty
    pages, then advise the kernel it may drop them. Returns the bytes still resident after
    (by `fincore`, when the host has it; -1 when it does not)."""
    paths = sorted(root.glob("blocks/*/*.kv"))
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    if shutil.which("fincore") is None or not paths:
        return -1
    listing = subprocess.run(
        ["fincore", "--bytes", "--noheadings", "--output", "RES", *map(str, paths)],
        capture_output=True,
        text=True,
        check=True,
    )
    return sum(int(line) for line in listing.stdout.split())


def summary(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {
        "p50_s": round(statistics.median(ordered), 4),
        "p90_s": round(ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))], 4),
        "n": len(ordered),
    }


def bench_restore(args: argparse.Namespace) -> dict[str, Any]:
    computed, warm, cold, hits, resident = [], [], [], [], []
    with directory() as root:
        llm = LLM(dtype=args.dtype, kv_cache_dir=str(root), kv_disk_size=args.disk_gib)
        serve(llm, random_prompt(999, 64))  # warm-up
        for repeat in range(args.repeats):
            prompt = random_prompt(repeat, args.prefix_tokens + 1)
            computed.append(ttft(serve(llm, prompt)))
            llm.engine.core.kv_tiers.flush(120.0)  # type: ignore[union-attr]
            for page_cache, times in (("warm", warm), ("cold", cold)):
                assert llm.reset_prefix_cache()
                if page_cache == "cold":
                    resident.append(drop_page_cache(root))
                output = serve(llm, prompt)
                hits.append(output.tier_cached_tokens.get("disk", 0))
                times.append(ttft(output))
        llm.shutdown()
    recompute = statistics.median(computed)
    return {
        "prefix_tokens": args.prefix_tokens,
        "disk_hit_tokens": sorted(set(hits)),
        "recompute_ttft_s": round(recompute, 4),
        "disk_warm_ttft_s": round(statistics.median(warm), 4),
        "disk_cold_ttft_s": round(statistics.median(cold), 4),
        "resident_bytes_after_drop": max(resident),
        "speedup_warm": round(recompute / statistics.median(warm), 1),
        "speedup_cold": round(recompute / statistics.median(cold), 1),
    }


def multiturn_ttfts(args: argparse.Namespace, kv_dir: Path | None) -> tuple[list[float], int]:
    tier_args: dict[str, Any] = {} if kv_dir is None else {"kv_cache_dir": str(kv_dir)}
    llm = LLM(dtype=args.dtype, num_gpu_blocks_override=args.device_blocks, **tier_args)
    params = SamplingParams(temperature=0.0, max_tokens=args.answer_tokens, ignore_eos=True)
    histories = [random_prompt(100 + c, args.turn_tokens) for c in range(args.conversations)]
    times, tier_tokens = [], 0
    for turn in range(args.turns):
        for conversation, history in enumerate(histories):
            if turn:
                history.extend(random_prompt(1000 * turn + conversation, args.turn_tokens))
            output = serve(llm, history, params)
            history.extend(output.outputs[0].token_ids)
            if turn:
                times.append(ttft(output))
                tier_tokens += sum(output.tier_cached_tokens.values())
    llm.shutdown()
    return times, tier_tokens


def bench_multiturn(args: argparse.Namespace) -> dict[str, Any]:
    without, _ = multiturn_ttfts(args, None)
    with directory() as root:
        with_disk, disk_tokens = multiturn_ttfts(args, root)
    return {
        "conversations": args.conversations,
        "turns": args.turns,
        "turn_tokens": args.turn_tokens,
        "device_blocks": args.device_blocks,
        "final_history_tokens": args.turns * (args.turn_tokens + args.answer_tokens),
        "no_tiers": summary(without),
        "disk_tier": summary(with_disk),
        "disk_hit_tokens": disk_tokens,
        "p50_ratio": round(statistics.median(with_disk) / statistics.median(without), 3),
    }


def bench_restart(args: argparse.Namespace) -> dict[str, Any]:
    warm, cold, hits = [], [], []
    for repeat in range(args.repeats):
        prompt = random_prompt(500 + repeat, args.prefix_tokens + 1)
        with directory() as root:
            first = LLM(dtype=args.dtype, kv_cache_dir=str(root))
            serve(first, prompt)
            first.shutdown()
            second = LLM(dtype=args.dtype, kv_cache_dir=str(root))
            output = serve(second, prompt)
            second.shutdown()
            warm.append(ttft(output))
            hits.append(output.tier_cached_tokens.get("disk", 0))
        with directory() as root:
            third = LLM(dtype=args.dtype, kv_cache_dir=str(root))
            cold.append(ttft(serve(third, prompt)))
            third.shutdown()
    return {
        "prefix_tokens": args.prefix_tokens,
        "disk_hit_tokens": sorted(set(hits)),
        "warm_restart_ttft_s": round(statistics.median(warm), 4),
        "cold_start_ttft_s": round(statistics.median(cold), 4),
        "ratio": round(statistics.median(warm) / statistics.median(cold), 3),
    }


def offload_steps(args: argparse.Namespace, kv_dir: Path | None) -> dict[str, Any]:
    tier_args: dict[str, Any] = {} if kv_dir is None else {"kv_cache_dir": str(kv_dir)}
    llm = LLM(dtype=args.dtype, **tier_args)
    serve(llm, random_prompt(999, 64))  # warm-up
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=args.decode_tokens, ignore_eos=True)
    for index in range(args.batch):  # driven step by step below, to time each step
        prompt = random_prompt(2000 + index, args.prefix_tokens)
        engine.add_request(RequestSpec(f"o{index}", prompt, params, 0, None))
    times = []
    while engine.has_unfinished_requests():
        started = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - started)
    stats = engine.stats().kv_tiers
    llm.shutdown()
    return {
        **summary(times),
        "total_s": round(sum(times), 3),
        "blocks_written": stats[0].stores if stats else 0,
        "dropped_writes": stats[0].dropped_writes if stats else 0,
    }


def bench_offload(args: argparse.Namespace) -> dict[str, Any]:
    off = offload_steps(args, None)
    with directory() as root:
        on = offload_steps(args, root)
    return {
        "batch": args.batch,
        "prefix_tokens": args.prefix_tokens,
        "decode_tokens": args.decode_tokens,
        "tiers_off": off,
        "disk_tier": on,
        "slowdown_total": round(on["total_s"] / off["total_s"] - 1, 3),
        "slowdown_p50": round(on["p50_s"] / off["p50_s"] - 1, 3),
    }


def bench_shared(args: argparse.Namespace) -> dict[str, Any]:
    from blockserve.bench.redis_server import RedisServer

    loaded, computed, hits = [], [], []
    with directory() as root:
        store = RedisServer(root, maxmemory="4gb")
        try:
            a = LLM(dtype=args.dtype, kv_remote_url=store.url)
            b = LLM(dtype=args.dtype, kv_remote_url=store.url)
            for llm in (a, b):  # a host's first build runs while an engine starts
                llm.engine.core.runner.kernels.loader.wait()
            for repeat in range(args.repeats):
                prompt = random_prompt(700 + repeat, args.prefix_tokens + 1)
                serve(a, prompt)
                a.engine.core.kv_tiers.flush(60)  # type: ignore[union-attr]
                output = serve(b, prompt)
                loaded.append(ttft(output))
                hits.append(output.tier_cached_tokens.get("remote", 0))
                computed.append(ttft(serve(b, random_prompt(800 + repeat, args.prefix_tokens + 1))))
            a.shutdown()
            b.shutdown()
        finally:
            store.stop()
    return {
        "prefix_tokens": args.prefix_tokens,
        "remote_hit_tokens": sorted(set(hits)),
        "from_shared_tier_ttft_s": round(statistics.median(loaded), 4),
        "recompute_ttft_s": round(statistics.median(computed), 4),
        "ratio": round(statistics.median(loaded) / statistics.median(computed), 3),
    }


SECTIONS = {
    "restore": bench_restore,
    "multiturn": bench_multiturn,
    "restart": bench_restart,
    "offload": bench_offload,
    "shared": bench_shared,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--section", nargs="+", choices=list(SECTIONS), default=list(SECTIONS))
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--prefix-tokens", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--disk-gib", type=float, default=8.0)
    parser.add_argument("--conversations", type=int, default=6)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--turn-tokens", type=int, default=128)
    parser.add_argument("--answer-tokens", type=int, default=64)
    parser.add_argument("--device-blocks", type=int, default=160)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/tiers/tiers.json"))
    args = parser.parse_args()
    results: dict[str, Any] = {
        "machine": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "dtype": args.dtype,
    }
    for name in args.section:
        results[name] = SECTIONS[name](args)
        print(name, results[name], flush=True)
    emit(results, args.out)


if __name__ == "__main__":
    main()
