"""The model runner: KV cache tensors, SchedulerOutput → model inputs, forward, sampling."""

from __future__ import annotations

from blockserve.runner.model_runner import ModelRunner

__all__ = ["ModelRunner"]
