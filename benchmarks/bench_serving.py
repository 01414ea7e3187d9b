"""HTTP serving benchmark: `blockserve bench serve` (blockserve/bench/serve.py says what it
measures), kept here for the scripts and docs that run it by path:

    .venv/bin/python benchmarks/bench_serving.py --dataset shared-prefix --compare-caching
"""

from __future__ import annotations

import argparse
import sys

from blockserve.bench.load import (
    VOCAB_HIGH,
    VOCAB_LOW,
    RequestResult,
    one_request,
    percentiles,
    summarize,
)
from blockserve.bench.serve import add_arguments, run_command

__all__ = ["VOCAB_HIGH", "VOCAB_LOW", "RequestResult", "one_request", "percentiles", "summarize"]

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_arguments(parser)
    sys.exit(run_command(parser.parse_args()))
