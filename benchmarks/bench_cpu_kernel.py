"""Our CPU kernels against torch's, paired, in one process on one model.

The engine's attention and layer math (blockserve/kernels: bfloat16, head dimension 64,
a CPU with AVX512-BF16) run either through our kernels or through torch's; each round runs one of
bench_offline.py's workloads once each way, in alternating order (as bench_compile.py does for
the compiled forward). Reports the wall times, medians, the ratio and how many requests
produced the same tokens both ways.

    .venv/bin/python benchmarks/bench_cpu_kernel.py [--compile] [--rounds 4] [--out FILE]
        [--kernels all|paged|layer] [--workload shared-prefix|no-sharing] [--requests 64]
        [--max-tokens 32]

`--kernels paged` switches only the paged decode (decodes reading their own blocks in place)
and keeps the other kernels on both ways; `--kernels layer` only the fused layer operators
(RMSNorm, residual adds, rotary embedding, SiLU-and-multiply). Defaults: the shared-prefix
workload (64 × (1,024 shared + 32 own tokens) → 32 tokens, greedy, prefix caching on);
`--workload no-sharing` gives each request 1,056 tokens of its own.
"""

from __future__ import annotations

import argparse
import statistics
from functools import partial
from pathlib import Path

from bench_compile import paired
from bench_offline import make_prompts
from report import emit

from blockserve import LLM, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--compile", action="store_true", help="the compiled forward")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--kernels", choices=("all", "paged", "layer"), default="all")
    parser.add_argument(
        "--workload", choices=("shared-prefix", "no-sharing"), default="shared-prefix"
    )
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()
    llm = LLM(max_num_seqs=args.requests, dtype="bfloat16", compile=args.compile)
    kernels = llm.engine.core.runner.kernels
    if not kernels.loader.wait():
        raise SystemExit("our CPU kernels are not available here (see the log)")
    torch_mode = {
        "all": partial(kernels.set_enabled, False),
        "paged": partial(kernels.set_enabled, True, paged=False),
        "layer": partial(kernels.set_enabled, True, layer=False),
    }[args.kernels]
    modes = {"torch": torch_mode, "ours": partial(kernels.set_enabled, True)}
    prompts = make_prompts(args.workload, args.requests, llm.engine.core.info.vocab_size)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    llm.generate(prompts[0][:64], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
    walls, same = paired(llm, prompts, params, modes, args.rounds)
    kernels.set_enabled(True)
    medians = {mode: round(statistics.median(times), 3) for mode, times in walls.items()}
    emit(
        {
            "benchmark": "cpu_kernel",
            "workload": args.workload,
            "kernels": args.kernels,
            "max_tokens": args.max_tokens,
            "compiled": args.compile,
            "wall_s": walls,
            "median_s": medians,
            "speedup": round(medians["torch"] / medians["ours"], 3),
            "same_tokens": same,
            "requests": len(prompts),
        },
        args.out,
    )


if __name__ == "__main__":
    main()
