"""A SmolVLM checkpoint loads and serves text: its text half is the decoder, its vision tower
and connector are left for the image path; greedy tokens equal transformers'
SmolVLMForConditionalGeneration's and, the text half being SmolLM2, today's engine's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import SmolVLMForConditionalGeneration

from blockserve import LLM, SamplingParams
from blockserve.model.arch import LlamaArchConfig
from blockserve.model.loader import read_arch
from tests.multimodal.smolvlm_model import IMAGE_TOKENS, save_test_smolvlm

pytestmark = pytest.mark.slow  # a checkpoint of SmolLM2's 135M weights and two engines

PROMPTS = ["The capital of France is", "One, two, three,", "def add(a, b):"]
TOKENS = 8


@pytest.fixture(scope="module")
def smolvlm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_test_smolvlm(tmp_path_factory.mktemp("smolvlm"))


def greedy(llm: LLM) -> list[list[int]]:
    outputs = llm.generate(PROMPTS, SamplingParams(max_tokens=TOKENS, temperature=0))
    return [list(o.outputs[0].token_ids) for o in outputs]


def test_the_text_half_is_read_as_a_llama(smolvlm_dir: Path) -> None:
    arch = read_arch(smolvlm_dir)
    assert isinstance(arch, LlamaArchConfig) and arch.model_type == "llama"
    assert (arch.num_layers, arch.hidden_size, arch.vocab_size) == (30, 576, 49152 + 40)
    assert len(IMAGE_TOKENS) == 40


def test_greedy_text_equals_transformers_and_todays_engine(smolvlm_dir: Path) -> None:
    ours = greedy(LLM(model=str(smolvlm_dir), dtype="float32"))
    reference = SmolVLMForConditionalGeneration.from_pretrained(
        smolvlm_dir, dtype=torch.float32
    ).eval()
    llm = LLM(dtype="float32")  # the embedded SmolLM2: the same text half
    tokenizer = llm.get_tokenizer()
    expected = []
    for prompt in PROMPTS:
        ids = torch.tensor([tokenizer.encode(prompt)])
        with torch.no_grad():
            out = reference.generate(input_ids=ids, max_new_tokens=TOKENS, do_sample=False)
        expected.append(out[0, ids.shape[1] :].tolist())
    assert ours == expected
    assert greedy(llm) == ours
