"""Offline throughput of the whole engine on the default model, with prefix caching on and off.

Workloads (greedy, ignore_eos):
  shared-prefix  64 requests: one shared 1,024-token prefix + a distinct 32-token suffix each,
                 32 output tokens.
  random         64 requests of 1,056 random tokens (no sharing), 32 output tokens.

Also times the scheduler (schedule + update_from_output) and the rest of the engine's
bookkeeping against the model runner, to show what the control plane costs per step, and
records each step's tokens and runner time (`runner_steps`).

    .venv/bin/blockserve bench offline [--workload shared-prefix random]
    (or .venv/bin/python benchmarks/bench_offline.py, the same command)

        [--caching on off] [--requests 64] [--dtype auto|float32] [--compile] [--profile N]
        [--max-tokens 32] [--paged-decode on|off] [--precached N] [--kv-written]
        [--lazy-memory] [--out FILE]

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
    sys.exit(run_command(parser.parse_args()))
