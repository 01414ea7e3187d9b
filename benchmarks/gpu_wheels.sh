#!/usr/bin/env bash
# Fetch, on a machine with a package index, the wheels that a GPU machine without one lacks
# for benchmarks/gpu_check.sh: its image has torch, triton, transformers and pytest, not
# msgspec (KV events), cbor2 (the sha256_cbor block hash) or llguidance (structured outputs),
# which `from blockserve import LLM` imports. They land in .whl/ (git-ignored);
# gpu_check.sh installs whatever is there. Python 3.12, x86-64 Linux, as on the H200 machines.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
rm -rf .whl && mkdir -p .whl
"$PY" -m pip download -q --no-deps --only-binary=:all: -d .whl \
    --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux_2_31_x86_64 \
    "msgspec==0.23.0" "cbor2==6.3.0" "llguidance==1.9.1"
ls -l .whl
