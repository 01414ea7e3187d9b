"""Compile the Triton kernels ahead of time for a GPU architecture (sm_90, Hopper, unless told)
and report what the compiler made of them; no GPU needed. Run without TRITON_INTERPRET
(interpreted kernels cannot compile):

    .venv/bin/python -m tests.attention.aot_compile [--capability 80]   # one JSON object a line

Each kernel is compiled with the launch parameters the triton backend uses, and with the
specialisation Triton applies at run time to this engine's tensors: every pointer 16-byte
aligned and every stride a multiple of 16 (head_dim is 64 or 128), except the block table's
row stride, which is the (arbitrary) number of blocks of the longest sequence.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from blockserve.attention.triton_kernels import (
    merge_splits_kernel,
    reshape_and_cache_kernel,
    unified_attention_kernel,
)
from blockserve.attention.triton_plan import MIN_BLOCK_M, PREFILL_BLOCK_M, kernel_config

TENSORS = {"out_ptr", "query_ptr", "key_cache_ptr", "value_cache_ptr", "key_ptr", "value_ptr"}
CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"


def signature(kernel: Any, dtype: str) -> tuple[dict[str, str], dict[tuple[int, ...], Any]]:
    """Argument types and run-time specialisation attributes of `kernel` for `dtype` data."""
    types, attrs = {}, {}
    for index, name in enumerate(kernel.arg_names):
        if name in TENSORS:
            types[name] = f"*{dtype}"
        elif name.startswith("partial"):
            types[name] = "*fp32"
        elif name.endswith("_ptr"):
            types[name] = "*i64"
        elif name == "scale":
            types[name] = "fp32"
        elif name.isupper():
            types[name] = "constexpr"
        else:
            types[name] = "i32"
        aligned = name.endswith("_ptr") or name.startswith("stride")
        if aligned and name != "stride_table_seq":
            attrs[(index,)] = [["tt.divisibility", 16]]
    return types, attrs


def compile_kernel(
    kernel: Any,
    dtype: str,
    constants: dict[str, Any],
    target: GPUTarget,
    num_warps: int = 4,
    num_stages: int = 3,
) -> dict[str, Any]:
    """Compile for `target`; the resources the compiled code needs, and whether it uses tensor
    cores (mma / wgmma) and asynchronous copies (a pipelined loop)."""
    types, attrs = signature(kernel, dtype)
    source = ASTSource(kernel, types, constexprs=constants, attrs=attrs)
    compiled = triton.compile(
        source, target=target, options={"num_warps": num_warps, "num_stages": num_stages}
    )
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        usage = subprocess.run(
            [str(CUOBJDUMP), "-res-usage", cubin.name], capture_output=True, text=True, check=True
        ).stdout
    resources = dict(re.findall(r"(REG|STACK|LOCAL):(\d+)", usage))
    ptx, ttgir = compiled.asm["ptx"], compiled.asm["ttgir"]
    return {
        "shared_bytes": compiled.metadata.shared,
        "registers": int(resources["REG"]),
        "stack_bytes": int(resources["STACK"]),
        "tensor_cores": "mma.sync" in ptx or "wgmma" in ptx,
        "async_copies": "async_copy_global_to_local" in ttgir,
    }


def attention_cases() -> Iterator[tuple[str, str, dict[str, Any], Any]]:
    """(name, dtype, constants, config) for each shape the triton backend launches."""
    # Llama-3-8B-like, GQA 3:1, no GQA, and the float32 shapes of tests/gpu (tiny model: d16).
    models = [("bf16", 128, 4), ("fp16", 64, 3), ("bf16", 64, 1), ("fp32", 64, 1), ("fp32", 16, 2)]
    for dtype, head_dim, queries_per_kv in models:
        smallest = max(MIN_BLOCK_M, triton.next_power_of_2(queries_per_kv))
        for block_m in (smallest, max(PREFILL_BLOCK_M, smallest)):
            config = kernel_config(block_m)
            for splits in (1, 8):
                constants = {
                    "QUERIES_PER_KV": queries_per_kv,
                    "BLOCK_SIZE": 16,
                    "HEAD_DIM": head_dim,
                    "BLOCK_Q": block_m // queries_per_kv,
                    "BLOCK_M": block_m,
                    "TILE_N": config.tile_n,
                    "NUM_SPLITS": splits,
                    "DOT_PRECISION": "ieee" if dtype == "fp32" else "tf32",
                }
                name = f"attention-{dtype}-d{head_dim}-g{queries_per_kv}-m{block_m}-s{splits}"
                yield name, dtype, constants, config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--capability", type=int, default=90, help="e.g. 80 (A100), 90 (H100)")
    target = GPUTarget("cuda", parser.parse_args().capability, 32)
    for name, dtype, constants, config in attention_cases():
        report = compile_kernel(
            unified_attention_kernel, dtype, constants, target, config.num_warps, config.num_stages
        )
        print(json.dumps({"kernel": name, "dtype": dtype, **report}), flush=True)
    for dtype, head_dim, splits in [("bf16", 128, 32), ("fp16", 64, 2)]:
        constants = {"HEAD_DIM": head_dim, "NUM_SPLITS": splits}
        report = compile_kernel(merge_splits_kernel, dtype, constants, target)
        name = f"merge-{dtype}-d{head_dim}-s{splits}"
        print(json.dumps({"kernel": name, "dtype": dtype, **report}), flush=True)
    for dtype, row in [("bf16", 8 * 128), ("fp16", 3 * 64)]:
        constants = {"BLOCK_SIZE": 16, "ROW": row, "ROW_POW2": triton.next_power_of_2(row)}
        report = compile_kernel(reshape_and_cache_kernel, dtype, constants, target)
        print(json.dumps({"kernel": f"cache-{dtype}-row{row}", "dtype": dtype, **report}))


if __name__ == "__main__":
    main()
