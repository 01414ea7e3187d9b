#!/usr/bin/env bash
# One prepared run for a machine with an NVIDIA GPU: build the csrc extension, run tests/gpu,
# then benchmark the attention kernels. Output goes to $OUT (default benchmarks/results).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-benchmarks/results}"
mkdir -p "$OUT"
make setup >/dev/null
PY=.venv/bin/python
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
echo "== building csrc"
time $PY -c "from blockserve.attention.cuda_backend import load_extension; load_extension(); print('built')"
echo "== tests/gpu and tests/attention"
$PY -m pytest -q tests/gpu tests/attention 2>&1 | tee "$OUT/gpu_tests.txt"
echo "== bench_attention"
$PY benchmarks/bench_attention.py --out "$OUT/attention.json" | tee "$OUT/attention.txt"
