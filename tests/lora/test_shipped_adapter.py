"""The shipped `capitals` adapter (adapters/, trained by adapters/train_capitals.py) loads on
the embedded model and does what it was trained for: the base model answers in mixed case, the
adapter in capitals."""

from __future__ import annotations

from pathlib import Path

import pytest

from blockserve import LLM, LoRARequest, SamplingParams

ADAPTER = Path(__file__).resolve().parents[2] / "adapters" / "capitals"


def upper_share(text: str) -> float:
    letters = [c for c in text if c.isalpha()]
    return sum(c.isupper() for c in letters) / len(letters)


@pytest.mark.slow
def test_the_shipped_adapter_answers_in_capitals() -> None:
    llm = LLM(enable_lora=True, max_lora_rank=8)
    conversation = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = {"prompt_token_ids": list(llm.engine.input_processor.chat_prompt(conversation))}
    params = SamplingParams(temperature=0, max_tokens=12)
    capitals = LoRARequest("capitals", 1, str(ADAPTER))
    base, tuned = llm.generate(
        [prompt, prompt], params, use_tqdm=False, lora_request=[None, capitals]
    )
    assert upper_share(base.outputs[0].text) < 0.5
    assert upper_share(tuned.outputs[0].text) > 0.9
    assert ADAPTER.joinpath("adapter_model.safetensors").stat().st_size <= 2 << 20
