"""Tiny PEFT adapters made in the test over a tiny base model: peft's own `get_peft_model`, B
made non-zero (peft starts it at zero), saved in PEFT's format."""

from __future__ import annotations

from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

ALL_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def save_adapter(
    base_dir: Path, path: Path, seed: int, rank: int = 4, modules: list[str] | None = None,
    rslora: bool = False,
) -> Path:  # fmt: skip
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    config = LoraConfig(
        r=rank, lora_alpha=2 * rank, target_modules=modules or ALL_MODULES, lora_dropout=0.0,
        use_rslora=rslora,
    )  # fmt: skip
    peft_model = get_peft_model(model, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
    peft_model.save_pretrained(path)
    return path


def peft_reference(base_dir: Path, adapter_dir: Path) -> torch.nn.Module:
    from peft import PeftModel

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    return PeftModel.from_pretrained(model, adapter_dir).eval()
