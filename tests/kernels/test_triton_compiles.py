"""TritonCompiles installs Triton's post-compile hook for its block, records each call by the
`repr` Triton passes, keeps calling the hook installed before, and restores it after. (Nothing
compiles without a CUDA device; tests/gpu/test_cuda_graphs.py counts real compilations.)"""

from __future__ import annotations

from typing import Any

from triton import knobs

from blockserve.kernels.triton_compiles import TritonCompiles


def test_the_hook_records_each_compilation_and_chains_the_previous() -> None:
    seen: list[str] = []

    def previous(**kwargs: Any) -> None:
        seen.append(kwargs["repr"])

    knobs.runtime.jit_post_compile_hook = previous
    try:
        with TritonCompiles() as compiles:
            hook = knobs.runtime.jit_post_compile_hook
            assert hook is not previous
            hook(key="k", repr="unified_attention_kernel[num_warps=4]", fn=None)
            hook(key="k2", repr="merge_splits_kernel[num_warps=4]", fn=None)
        assert compiles.kernels == [
            "unified_attention_kernel[num_warps=4]",
            "merge_splits_kernel[num_warps=4]",
        ]
        assert seen == compiles.kernels
        assert knobs.runtime.jit_post_compile_hook is previous
    finally:
        knobs.runtime.jit_post_compile_hook = None
