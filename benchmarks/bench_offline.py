"""Offline throughput of the whole engine on the default model, with prefix caching on and off.

Workloads (greedy, ignore_eos):
  shared-prefix  64 requests: one shared 1,024-token prefix + a distinct 32-token suffix each,
                 32 output tokens.
  random         64 requests of 1,056 random tokens (no sharing), 32 output tokens.

Also times the scheduler (schedule + update_from_output) and the rest of the engine's
bookkeeping against the model runner, to show what the control plane costs per step, and
records each step's tokens and runner time (`runner_steps`).

    .venv/bin/blockserve bench offline [--workload shared-prefix random]
        [--caching on off] [--requests 64] [--dtype auto|float32] [--compile] [--profile N]
        [--max-tokens 32] [--paged-decode on|off] [--precached N] [--kv-written] [--out FILE]

This script is the same command, plus `--lazy-memory` (a one-off: it patches the engine).

`--paged-decode off` keeps our paged-decode kernel out (blockserve/kernels; torch's
decode path serves), to profile the step without it. `--precached N` caches the first N
tokens of the first prompt before the run (a system prompt partly seen before): the first
request then computes the rest of the prefix on top of them in the same step as the others
find it cached. `--kv-written` writes every page of the KV cache (zeros, so nothing changes)
before the run: the cache is mapped in page by page as first written (runner/kv_cache.py), and
this shows what those first writes cost the run. `--lazy-memory` runs the engine as it was
before runner/page_mapping.py: no KV pages mapped in ahead of their first write, glibc's malloc
limits left as they are; `kv_blocks_mapped_at_start` says how far the engine had mapped ahead
when the timed run began.
"""

from __future__ import annotations

import argparse
import sys

from blockserve.bench.offline import add_arguments, make_prompts, run_command

__all__ = ["make_prompts"]

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_arguments(parser)
    parser.add_argument(
        "--lazy-memory",
        action="store_true",
        help="no KV pages mapped in ahead, glibc's malloc limits as they are",
    )
    args = parser.parse_args()
    if args.lazy_memory:  # the engine's runner then gets no page populator (0 blocks ahead)
        from blockserve.engine import core as engine_core

        engine_core.blocks_per_step = lambda *_: 0
    sys.exit(run_command(args, {"lazy_memory": args.lazy_memory}))
