"""One user's decode, blockserve against llama.cpp (`bench_vs_vllm.py --workload one-stream`).

The GGUF file the default model ships as (SmolLM2-135M-Instruct, Q4_1 layers, a Q8_0
embedding) in three engines, each in its own process, taking turns `repeats` times:
  blockserve       the file dequantized to --dtype at load (the default);
  blockserve-gguf  `--quantization gguf`: the file's blocks read as they are for decode steps;
  llama.cpp        llama-cpp-python from .peer-llamacpp (`make peer-llamacpp`), a thread a CPU.
The same chat prompt's token ids, greedy. A run's figure: decode tokens/s = (128 − 1) tokens
over the time from a 128-token request's first token to its last, the median of 3 requests
(blockserve's from the request's own metrics, llama.cpp's as its generator yields them); every
engine is measured the same way. Also: the tokens each blockserve engine shares with
llama.cpp's before the first difference. `--dry-run`: blockserve's engines alone
(the gguf one where the host runs its kernel), 8 tokens.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

PROMPT = "Write a long story about a lighthouse keeper and the sea."
TOKENS = 128
ENGINES = ("blockserve", "blockserve-gguf", "llama.cpp")
PYTHONS = {"blockserve": ".venv/bin/python", "llama.cpp": ".peer-llamacpp/bin/python"}


def prompt_ids() -> list[int]:
    from blockserve.model.loader import load_tokenizer, resolve_model_dir

    tokenizer = load_tokenizer(resolve_model_dir(None))
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": PROMPT}], add_generation_prompt=True
    )
    return list(ids)


def _timed(generate: Any, tokens: int) -> dict[str, Any]:
    """Three requests of `tokens` tokens (`generate(n)`: the tokens, the seconds from the call to
    the first token and from the first token to the last): the medians and the last tokens."""
    walls, firsts, spans, out = [], [], [], []
    for _ in range(3):
        start = time.perf_counter()
        out, first, span = generate(tokens)
        walls.append(time.perf_counter() - start)
        firsts.append(first)
        spans.append(span)
    return {
        "decode_tokens_per_s": round((tokens - 1) / statistics.median(spans), 2),
        "request_tokens_per_s": round(tokens / statistics.median(walls), 2),
        "prefill_s": round(statistics.median(firsts), 4),
        "tokens": out,
    }


def run_engine(engine: str, ids: list[int], gguf: str, tokens: int = TOKENS) -> dict[str, Any]:
    """In this process: one engine's decode tokens/s and its `tokens` tokens."""
    if engine == "llama.cpp":
        from llama_cpp import Llama

        llama = Llama(model_path=gguf, n_threads=os.cpu_count(),
                      n_ctx=1024, verbose=False)  # fmt: skip

        def generate(n: int) -> tuple[list[int], float, float]:
            llama.reset()  # else generate() reuses the last call's prompt from its cache
            out: list[int] = []
            start = first = time.perf_counter()
            for token in llama.generate(ids, temp=0.0, top_k=1, reset=True):
                out.append(token)
                if len(out) == 1:
                    first = time.perf_counter()
                if len(out) == n:
                    break
            return out, first - start, time.perf_counter() - first
    else:
        from blockserve import LLM, SamplingParams

        kwargs = {"quantization": "gguf"} if engine == "blockserve-gguf" else {}
        # No prefix caching: every request computes its prompt, as llama.cpp's do here.
        llm = LLM(enable_prefix_caching=False, **kwargs)
        llm.engine.core.runner.kernels.loader.wait()  # built or loaded, the weights packed

        def generate(n: int) -> tuple[list[int], float, float]:
            params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
            (out,) = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
            times = out.metrics  # monotonic seconds of the request's milestones
            first = times.first_token_time - times.arrival_time
            return (
                list(out.outputs[0].token_ids),
                first,
                times.finished_time - times.first_token_time,
            )

    generate(tokens)  # warm-up
    return _timed(generate, tokens)


def launch(engine: str, ids: list[int], gguf: str, tokens: int) -> dict[str, Any]:
    python = Path(PYTHONS["llama.cpp" if engine == "llama.cpp" else "blockserve"])
    if not python.exists():
        raise SystemExit(f"{python} is missing: run `make peer-llamacpp` first")
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    done = subprocess.run(
        [str(python), __file__, engine, json.dumps(ids), gguf, str(tokens)],
        env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        raise SystemExit(f"{engine} failed:\n{done.stderr[-3000:]}")
    return json.loads(lines[-1].removeprefix("RESULT "))


def _shared_prefix(a: list[int], b: list[int]) -> int:
    differ = (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
    return next(differ, min(len(a), len(b)))


def race(repeats: int, dry_run: bool = False) -> dict[str, Any]:
    """Every engine `repeats` times, taking turns; each one's median run and every run.
    `dry_run`: blockserve's engines alone (the gguf one where this host runs its kernel), 8
    tokens."""
    import torch

    from blockserve.kernels.build import can_build
    from blockserve.model.loader import default_model_path

    engines, tokens = ENGINES, TOKENS
    if dry_run:
        engines, tokens = ENGINES[:2] if can_build(torch.bfloat16) else ENGINES[:1], 8

    ids, gguf = prompt_ids(), str(default_model_path())
    runs: dict[str, list[dict[str, Any]]] = {engine: [] for engine in engines}
    for _ in range(repeats):
        for engine in engines:
            runs[engine].append(launch(engine, ids, gguf, tokens))
            print(engine, runs[engine][-1]["decode_tokens_per_s"], "tokens/s", flush=True)
    result: dict[str, Any] = {"prompt_tokens": len(ids), "output_tokens": tokens}
    for engine, done in runs.items():
        rates = [run["decode_tokens_per_s"] for run in done]
        result[engine] = {
            "decode_tokens_per_s": statistics.median(rates),
            "decode_ms_per_token": round(1000 / statistics.median(rates), 3),
            "decode_tokens_per_s_runs": rates,
            "request_tokens_per_s": statistics.median(r["request_tokens_per_s"] for r in done),
            "tokens": done[-1]["tokens"],
        }
    if "llama.cpp" in runs:
        peer = result["llama.cpp"]
        for engine in (e for e in engines if e != "llama.cpp"):
            mine = result[engine]
            ratio = mine["decode_tokens_per_s"] / peer["decode_tokens_per_s"]
            mine["vs_llama_cpp"] = round(ratio, 3)
            mine["tokens_equal_to_llama_cpp"] = _shared_prefix(mine["tokens"], peer["tokens"])
    return result


if __name__ == "__main__":
    engine, ids, gguf, tokens = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3], sys.argv[4]
    print("RESULT " + json.dumps(run_engine(engine, ids, gguf, int(tokens))), flush=True)
