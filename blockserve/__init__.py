"""blockserve: an LLM inference-serving engine built around a hashed-block prefix cache.

The package root stays light: `LLM` (which needs torch) is imported on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from blockserve.sampling_params import SamplingParams, StructuredOutputsParams

if TYPE_CHECKING:
    from blockserve.engine.llm import LLM
    from blockserve.lora.adapter import LoRARequest

__version__ = "0.1.0"
__all__ = ["LLM", "LoRARequest", "SamplingParams", "StructuredOutputsParams", "__version__"]


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from blockserve.engine.llm import LLM

        return LLM
    if name == "LoRARequest":
        from blockserve.lora.adapter import LoRARequest

        return LoRARequest
    raise AttributeError(f"module 'blockserve' has no attribute {name!r}")
