"""The adapters the LoRA tests share: two tiny PEFT adapters over the tiny base model."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.lora.adapters import save_adapter


@pytest.fixture(scope="session")
def adapters(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """`every`: rank 4 on all seven projections; `qv`: rank-8 rsLoRA on q and v."""
    root = tmp_path_factory.mktemp("adapters")
    return {
        "every": save_adapter(tiny_llama_dir, root / "every", seed=1),
        "qv": save_adapter(
            tiny_llama_dir, root / "qv", seed=2, rank=8, modules=["q_proj", "v_proj"], rslora=True
        ),
    }
