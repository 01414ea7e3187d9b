"""This tree against a git revision, taking turns on one measure: for a host whose speed moves
by half within minutes, where separate runs cannot show a change of a few percent.

The revision is checked out into a worktree in a temporary folder and its kernels are built
into a cache of their own (two trees sharing one cache would rebuild each other's libraries).
Each tree runs as one persistent worker process, the same script in `--worker` mode; each
round asks both for one measurement, the order swapped every round, so that both see the same
minutes of the host. The result: each tree's median, the median of the per-round ratios
(this tree ÷ the revision: below 1, this tree is faster) and in how many rounds this tree was
the faster. The workers inherit the environment: bind the threads
(VLLM_CPU_OMP_THREADS_BIND=0-<cores - 1>, recorded in the result) or the adaptive thread count
adds its own noise.

Measures (each measurement a median of several calls):
  one-stream     the median engine step of a 64-token greedy request on the default model,
                 one sequence (`--quantization gguf` with --gguf)
  dense-544      `dense_attention` over one causal 544-token prompt, 9 query heads over 3
  paged-decode   `paged_decode` of 16 sequences × 560 keys, per layer over 30 layers' caches
  shared-decode  `decode_attention` of a shared-prefix decode step: 64 sequences × (1,024
                 common keys, packed once as the engine keeps them, + 48 own), over 30 layers
  vector-64      `vector_linear` (bf16) of 64 rows through one layer of the default model's
                 four product shapes: a shared-prefix decode step's
  prefill-544    the engine step that prefills one 544-token prompt on the default model
  prefill-2048   the same for a 2,048-token prompt: one full chunk of a prefill
  no-sharing     the wall time of bench_vs_vllm.py's no-sharing workload (16 × 544 prompt
                 tokens, 32 out, prefix caching off), new prompts each round (one measurement)
  shared-prefix  the same for its shared-prefix workload (64 × (1,024 shared + 32 own)
                 prompt tokens, 32 out, prefix caching on), a new prefix each round

    .venv/bin/python benchmarks/bench_ab.py REV MEASURE [--gguf] [--rounds 24] [--out FILE]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

ROOT = Path(__file__).resolve().parent.parent
MEASURES = (
    "one-stream",
    "dense-544",
    "paged-decode",
    "shared-decode",
    "vector-64",
    "prefill-544",
    "prefill-2048",
    "no-sharing",
    "shared-prefix",
)


def summarize(here: list[float], there: list[float]) -> dict[str, Any]:
    """Both trees' measurements, round by round (seconds) → medians (ms), the median ratio
    here ÷ there, and the rounds in which here was the faster."""
    ratios = [a / b for a, b in zip(here, there, strict=True)]
    return {
        "rounds": len(ratios),
        "here_ms": round(statistics.median(here) * 1e3, 4),
        "revision_ms": round(statistics.median(there) * 1e3, 4),
        "ratio": round(statistics.median(ratios), 4),
        "here_faster_rounds": sum(r < 1 for r in ratios),
    }


def take_turns(
    here: Callable[[], float], there: Callable[[], float], rounds: int
) -> tuple[list[float], list[float]]:
    """`rounds` measurements from each side, here first in even rounds, there first in odd."""
    measured: tuple[list[float], list[float]] = ([], [])
    sides = (here, there)
    for round_ in range(rounds):
        for side in (0, 1) if round_ % 2 == 0 else (1, 0):
            measured[side].append(sides[side]())
    return measured


# ---- the workers: each builds its measure once, then answers one line per round ----------


def _median_of(fn: Callable[[], object], calls: int) -> float:
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _timed_engine(**options: Any) -> tuple[Any, list[float]]:
    """An `LLM` on the default model whose engine steps' times land in the list returned."""
    from blockserve import LLM

    llm = LLM(**options)
    llm.engine.core.runner.kernels.loader.wait()
    engine, steps = llm.engine, []
    step = engine.step

    def timed_step(**kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return step(**kwargs)
        finally:
            steps.append(time.perf_counter() - start)

    engine.step = timed_step
    return llm, steps


def _one_stream(gguf: bool) -> Callable[[], float]:
    from blockserve import SamplingParams

    options = {"quantization": "gguf"} if gguf else {}
    llm, steps = _timed_engine(enable_prefix_caching=True, **options)
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    prompt = [100 + i for i in range(32)]

    def measure() -> float:
        steps.clear()
        llm.generate([prompt], params, use_tqdm=False)
        return statistics.median(steps[1:])  # the decode steps; the first is the prefill

    return measure


def _fresh_prompts(seed: int, count: int, length: int) -> list[list[int]]:
    """`count` random prompts of `length` token ids, the same for both trees in a round."""
    import random

    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(length)] for _ in range(count)]


def _prefill(length: int) -> Callable[[], float]:
    from blockserve import SamplingParams

    llm, steps = _timed_engine(enable_prefix_caching=False)
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    seeds = iter(range(1 << 30))

    def prefill() -> None:
        steps.clear()
        llm.generate(_fresh_prompts(next(seeds), 1, length), params, use_tqdm=False)

    def measure() -> float:
        times = []
        for _ in range(5):
            prefill()
            times.append(steps[0])
        return statistics.median(times)

    return measure


def _no_sharing() -> Callable[[], float]:
    from blockserve import SamplingParams

    llm, _ = _timed_engine(enable_prefix_caching=False, max_num_seqs=64)
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    seeds = iter(range(1 << 30))

    def measure() -> float:
        prompts = _fresh_prompts(next(seeds), 16, 544)
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - start

    return measure


def _shared_prefix() -> Callable[[], float]:
    from blockserve import SamplingParams

    llm, _ = _timed_engine(enable_prefix_caching=True, max_num_seqs=64)
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    seeds = iter(range(1 << 30))

    def measure() -> float:
        (prefix,) = _fresh_prompts(next(seeds), 1, 1024)
        prompts = [prefix + own for own in _fresh_prompts(next(seeds), 64, 32)]
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - start

    return measure


def _kernels() -> Any:
    import torch

    from blockserve.config import default_cache_dir
    from blockserve.kernels.loader import KernelLoader

    ops = KernelLoader().load(default_cache_dir(), torch.bfloat16)
    if ops is None:
        raise SystemExit("the bf16 kernels do not load on this host (AVX512-BF16 needed)")
    try:  # attention's products widened where an engine on this host widens them
        try:
            from blockserve.model.weight_copies import widening_pays
        except ImportError:  # a revision from before the copies left model/packed.py
            from blockserve.model.packed import widening_pays

        widen = ops.use_wide_attention
    except (ImportError, AttributeError, RuntimeError):
        return ops  # a revision from before widened attention
    widen(widening_pays(ops))
    return ops


def _dense_544() -> Callable[[], float]:
    import torch

    from blockserve.attention.prefill import causal_counts

    ops, length = _kernels(), 544
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(length, h, 64, generator=generator).bfloat16() for h in (9, 3, 3))
    rows = q.view(length, 3, 3, 64).permute(1, 2, 0, 3).reshape(1, 3, 3 * length, 64)
    counts = causal_counts(length, length, 3, q.device)
    keys, values = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
    return lambda: _median_of(
        lambda: ops.dense_attention(rows, keys, values, counts, 0.125), calls=10
    )


def _layer_caches(blocks: int, generator: Any, layers: int = 30) -> list[tuple[Any, Any]]:
    """Each layer's K and V caches of `blocks` blocks of 16 tokens, 3 KV heads, random bf16."""
    import torch

    return [
        tuple(torch.randn(blocks, 16, 3, 64, generator=generator).bfloat16() for _ in range(2))
        for _ in range(layers)
    ]


def _paged_decode() -> Callable[[], float]:
    import torch

    ops, seqs, keys = _kernels(), 16, 560
    generator = torch.Generator().manual_seed(0)
    per_seq = (keys + 15) // 16
    blocks = seqs * per_seq
    caches = _layer_caches(blocks, generator)
    table = torch.randperm(blocks, generator=generator).view(seqs, per_seq).to(torch.int32)
    lengths = torch.full((seqs,), keys, dtype=torch.int32)
    q = torch.randn(seqs, 9, 64, generator=generator).bfloat16()

    def every_layer() -> None:
        for k_cache, v_cache in caches:
            ops.paged_decode(q, k_cache, v_cache, table, lengths, 0.125, None, None)

    return lambda: _median_of(every_layer, calls=5) / len(caches)


def _shared_decode() -> Callable[[], float]:
    import torch

    ops, seqs, common_blocks, own_blocks = _kernels(), 64, 64, 3
    generator = torch.Generator().manual_seed(0)
    caches = _layer_caches(1 + common_blocks + seqs * own_blocks, generator)
    common = torch.arange(1, 1 + common_blocks)
    own = (1 + common_blocks + torch.arange(seqs * own_blocks)).view(seqs, own_blocks)
    lengths = torch.full((seqs,), 48, dtype=torch.int32)
    q = torch.randn(seqs, 9, 64, generator=generator).bfloat16()
    packed = [ops.pack_common(k_cache, v_cache, common) for k_cache, v_cache in caches]

    def step() -> None:
        for (k_cache, v_cache), pack in zip(caches, packed, strict=True):
            ops.decode_attention(q, k_cache, v_cache, own, lengths, 0.125, common, pack)

    return lambda: _median_of(step, calls=5)


def _vector_64() -> Callable[[], float]:
    import torch

    ops, generator = _kernels(), torch.Generator().manual_seed(0)
    shapes = ((960, 576), (576, 576), (3072, 576), (576, 1536))  # qkv, o, gate/up, down
    weights = [
        ops.vector_pack(torch.randn(n, k, generator=generator).bfloat16()) for n, k in shapes
    ]
    xs = [torch.randn(64, k, generator=generator).bfloat16() for _, k in shapes]

    def one_layer() -> None:
        for x, weight in zip(xs, weights, strict=True):
            ops.vector_linear(x, weight, None)

    return lambda: _median_of(one_layer, calls=20)


def worker(measure_name: str, gguf: bool, stdin: IO[str], stdout: IO[str]) -> None:
    """Build the measure, say `ready`, then answer each line of stdin with one measurement."""
    measure = {
        "one-stream": lambda: _one_stream(gguf),
        "dense-544": _dense_544,
        "paged-decode": _paged_decode,
        "shared-decode": _shared_decode,
        "vector-64": _vector_64,
        "prefill-544": lambda: _prefill(544),
        "prefill-2048": lambda: _prefill(2048),
        "no-sharing": _no_sharing,
        "shared-prefix": _shared_prefix,
    }[measure_name]()
    measure()  # warm
    print("ready", file=stdout, flush=True)
    for _ in stdin:
        print(measure(), file=stdout, flush=True)


# ---- the driver ----------------------------------------------------------------------------


def start_worker(tree: Path, cache: Path | None, args: argparse.Namespace) -> subprocess.Popen:
    """This script as a worker on `tree`'s blockserve (its kernels cached in `cache`, or the
    default cache): the revision need not have this script."""
    env = dict(os.environ, PYTHONPATH=str(tree))
    if cache is not None:
        env["BLOCKSERVE_CACHE_DIR"] = str(cache)
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", args.measure]
    process = subprocess.Popen(
        command + (["--gguf"] if args.gguf else []),
        cwd=tree,
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert process.stdout is not None
    if process.stdout.readline().strip() != "ready":
        raise SystemExit(f"the worker in {tree} did not start")
    return process


def ask(process: subprocess.Popen) -> float:
    assert process.stdin is not None and process.stdout is not None
    process.stdin.write("go\n")
    process.stdin.flush()
    return float(process.stdout.readline())


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("revision", nargs="?", help="a git revision of this repository")
    parser.add_argument("measure", nargs="?", choices=MEASURES)
    parser.add_argument("--gguf", action="store_true", help="one-stream: --quantization gguf")
    parser.add_argument("--rounds", type=int, default=24)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--worker", choices=MEASURES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        worker(args.worker, args.gguf, sys.stdin, sys.stdout)
        return
    if args.revision is None or args.measure is None:
        parser.error("give a revision and a measure")
    from report import emit

    commit = subprocess.run(
        ["git", "rev-parse", args.revision], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.strip()
    with tempfile.TemporaryDirectory() as scratch:
        checkout = Path(scratch) / "revision"
        subprocess.run(
            ["git", "worktree", "add", "--detach", str(checkout), commit],
            cwd=ROOT,
            check=True,
            capture_output=True,
        )
        try:
            workers = [
                start_worker(ROOT, None, args),
                start_worker(checkout, Path(scratch) / "kernels", args),
            ]
            here, there = take_turns(lambda: ask(workers[0]), lambda: ask(workers[1]), args.rounds)
            for process in workers:
                assert process.stdin is not None
                process.stdin.close()
                process.wait()
        finally:
            subprocess.run(
                ["git", "worktree", "remove", "--force", str(checkout)], cwd=ROOT, check=False
            )
    emit(
        {
            "benchmark": "ab",
            "measure": args.measure + (" --gguf" if args.gguf else ""),
            "revision": commit,
            "threads_bound": os.environ.get("VLLM_CPU_OMP_THREADS_BIND"),
            **summarize(here, there),
        },
        args.out,
    )


if __name__ == "__main__":
    main()
