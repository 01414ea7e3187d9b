"""The LoRA options of `EngineArgs` (vLLM's flags), declared apart: `EngineArgs` inherits
them. Imports no torch."""

from __future__ import annotations

from dataclasses import dataclass

from blockserve.engine import arg_checks
from blockserve.options import option, positive


@dataclass(frozen=True, slots=True)
class LoRAArgs:
    """--enable-lora and the adapters' bounds (docs/lora.md)."""

    enable_lora: bool = option(
        False, "serve LoRA adapters: a request names one by `model` (docs/lora.md)"
    )
    lora_modules: tuple[str, ...] = option(
        (),
        "adapters read at start-up (implies --enable-lora), each name=path or vLLM's JSON "
        '\'{"name": ..., "path": ..., "base_model_name": ...}\' (with --enable-lora)',
        check=arg_checks.lora_modules,
    )
    max_loras: int = option(
        1, "adapters the runner holds at once (one step's most)", check=positive
    )
    max_lora_rank: int = option(16, "the largest adapter rank served", check=positive)
    max_cpu_loras: int | None = option(
        None, "adapters kept loaded in host memory (default: --max-loras)", check=positive
    )
