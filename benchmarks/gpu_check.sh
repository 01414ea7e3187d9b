#!/usr/bin/env bash
# One prepared run for a machine with an NVIDIA GPU, in at most 6 minutes: build the csrc
# extension (beside the tests), run the device tests, benchmark the whole engine (CUDA graphs;
# then async scheduling, and eager steps for their launch count), check the kernels' memory
# accesses with compute-sanitizer, then sweep the attention kernels. Each stage has a time cap
# (90 + 120 + 75 + 30 + 45 s), so one that hangs leaves the others their time. Results go to
# $OUT (default benchmarks/results/gpu): gpu.txt, build.txt, gpu_tests.txt, engine.json,
# engine.txt, engine_async.json, engine_eager.json, variants.txt, sanitizer.txt,
# attention.json, attention.txt.
#
# It uses the machine's own python3 with its torch and triton (no `make setup`: such machines
# may have no package index). Packages they lack come as wheels from .whl/, which
# benchmarks/gpu_wheels.sh fills on a machine that has an index.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-benchmarks/results/gpu}"
PY="${PYTHON:-python3}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/blockserve-site .whl/*.whl
    export PYTHONPATH="/tmp/blockserve-site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}"
{
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
    "$PY" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
    nvcc --version | tail -1
} 2>&1 | tee "$OUT/gpu.txt"

echo "== building csrc (in the background; the cuda backend's tests wait for it)"
start=$SECONDS
( timeout 150 "$PY" -c "from blockserve.attention.cuda_backend import load_extension; load_extension()" \
    >"$OUT/build.txt" 2>&1 && status=built || status=FAILED
  echo "csrc $status in $((SECONDS - start)) s" >>"$OUT/build.txt" ) &
build=$!

echo "== device tests (at most 90 s)"
# The device set: tests/gpu, the triton and torch backends on the device, shared-prefix
# attention on torch's kernels, the Triton layer operators, the sm_90 PTX check. Left to CI,
# which runs them on every submission: the shared-prefix variants on our CPU kernels (they build every CPU kernel
# library first), the triton AOT compile and the bindings' type check (neither needs a GPU),
# and test_selector (it starts `blockserve serve`, whose web packages such a machine lacks).
timeout 90 "$PY" -m pytest -q -p no:cacheprovider tests/gpu tests/attention/test_triton_backend.py \
    tests/attention/test_torch_backend.py tests/attention/test_shared_prefix.py tests/kernels \
    "tests/attention/test_csrc.py::test_kernels_compile_to_ptx_for_sm90" -k "not ours" \
    2>&1 | tee "$OUT/gpu_tests.txt" || true
wait "$build" || true
tail -1 "$OUT/build.txt"

echo "== bench_gpu_engine (at most 120 s)"
timeout 120 "$PY" benchmarks/bench_gpu_engine.py --out "$OUT/engine.json" 2>&1 \
    | tee "$OUT/engine.txt" || true

echo "== bench_gpu_engine variants: async scheduling, eager steps (at most 75 s)"
timeout 45 "$PY" benchmarks/bench_gpu_engine.py --shapes llama-3.2-1b --workloads decode-heavy \
    --no-parity --runs warm --async-scheduling --out "$OUT/engine_async.json" 2>&1 \
    | tee "$OUT/variants.txt" || true
timeout 30 "$PY" benchmarks/bench_gpu_engine.py --shapes smollm2-135m --workloads shared-prefix \
    --no-parity --runs warm --enforce-eager --out "$OUT/engine_eager.json" 2>&1 \
    | tee -a "$OUT/variants.txt" || true

echo "== compute-sanitizer memcheck: the kernels against the torch backend, bf16 (at most 30 s)"
# Without torch's caching allocator every tensor is its own allocation, so an out-of-bounds
# access shows even where it would land inside a pooled block.
if command -v compute-sanitizer >/dev/null; then
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 30 compute-sanitizer --tool memcheck \
        --print-limit 20 "$PY" -m pytest -q -p no:cacheprovider tests/gpu -k "backend_matches_torch and bfloat16" \
        >"$OUT/sanitizer.txt" 2>&1 || true
    tail -5 "$OUT/sanitizer.txt"
else
    echo "compute-sanitizer is not installed here" | tee "$OUT/sanitizer.txt"
fi

echo "== bench_attention --sweep (at most 45 s)"
timeout 45 "$PY" benchmarks/bench_attention.py --sweep --out "$OUT/attention.json" 2>&1 \
    | tee "$OUT/attention.txt" || true
echo "== done in $SECONDS s"
