"""Images through the engine and its prefix cache, on the test SmolVLM (SmolLM2's text half, a
seeded SigLIP): greedy tokens equal transformers' SmolVLMForConditionalGeneration fed the
same pixels (one image, two images, a prefill chunked through an image); the same image again
is cached through it, another image stops the hit at the first block it touches."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from tokenizers import Tokenizer
from transformers import SmolVLMForConditionalGeneration
from transformers.models.smolvlm.image_processing_pil_smolvlm import SmolVLMImageProcessorPil
from transformers.models.smolvlm.processing_smolvlm import get_image_prompt_string

from blockserve import LLM, SamplingParams
from blockserve.multimodal.idefics3 import FAKE_TOKEN, GLOBAL_TOKEN, IMAGE_TOKEN
from tests.multimodal.images import pixels
from tests.multimodal.smolvlm_model import save_test_smolvlm

pytestmark = pytest.mark.slow  # a checkpoint of SmolLM2's 135M weights and engines over it

TOKENS = 8
ONE = "<|im_start|>User:<image>Describe the image.<end_of_utterance>\nAssistant:"
TWO = "<|im_start|>User:<image>and<image>: which is brighter?<end_of_utterance>\nAssistant:"
GREEDY = SamplingParams(max_tokens=TOKENS, temperature=0)


@pytest.fixture(scope="module")
def smolvlm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_test_smolvlm(tmp_path_factory.mktemp("smolvlm"))


@pytest.fixture(scope="module")
def llm(smolvlm_dir: Path) -> LLM:
    return LLM(model=str(smolvlm_dir), dtype="float32")


def picture(seed: int, height: int = 40, width: int = 70) -> Image.Image:
    return Image.fromarray(pixels(seed, height, width, 3))


def transformers_greedy(directory: Path, prompt: str, images: list[Image.Image]) -> list[int]:
    """transformers' own processing of the text and pixels, and its generate."""
    config = json.loads((directory / "config.json").read_text())
    processor = SmolVLMImageProcessorPil(
        **json.loads((directory / "preprocessor_config.json").read_text())
    )
    processed = processor(images, return_row_col_info=True)
    vision = config["vision_config"]
    seq_len = (vision["image_size"] // vision["patch_size"]) ** 2 // config["scale_factor"] ** 2
    pieces = prompt.split(IMAGE_TOKEN)
    text = pieces[0]
    for index, piece in enumerate(pieces[1:]):
        rows, cols = processed["rows"][0][index], processed["cols"][0][index]
        text += get_image_prompt_string(rows, cols, seq_len, FAKE_TOKEN, IMAGE_TOKEN, GLOBAL_TOKEN)
        text += piece
    ids = Tokenizer.from_file(str(directory / "tokenizer.json")).encode(text).ids
    model = SmolVLMForConditionalGeneration.from_pretrained(directory, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(
            input_ids=torch.tensor([ids]),
            pixel_values=torch.from_numpy(np.asarray(processed["pixel_values"])),
            pixel_attention_mask=torch.from_numpy(np.asarray(processed["pixel_attention_mask"])),
            max_new_tokens=TOKENS,
            do_sample=False,
        )
    return out[0, len(ids) :].tolist()


def generate(llm: LLM, prompt: str, images: list[Image.Image]) -> tuple[list[int], int]:
    (out,) = llm.generate({"prompt": prompt, "multi_modal_data": {"image": images}}, GREEDY)
    return list(out.outputs[0].token_ids), out.num_cached_tokens or 0


@pytest.mark.parametrize(
    ("prompt", "seeds"), [(ONE, [5]), (TWO, [6, 7])], ids=["one image", "two images"]
)
def test_greedy_tokens_equal_transformers(
    llm: LLM, smolvlm_dir: Path, prompt: str, seeds: list[int]
) -> None:
    images = [picture(seed) for seed in seeds]
    tokens, _ = generate(llm, prompt, images)
    assert tokens == transformers_greedy(smolvlm_dir, prompt, images)


def test_a_prefill_chunked_through_an_image_gives_the_same_tokens(smolvlm_dir: Path) -> None:
    """16 tokens a step: the image's span (its tiles' tokens) arrives over several steps."""
    chunked = LLM(model=str(smolvlm_dir), dtype="float32", max_num_batched_tokens=16)
    images = [picture(5)]
    tokens, _ = generate(chunked, ONE, images)
    assert tokens == transformers_greedy(smolvlm_dir, ONE, images)


def test_async_scheduling_gives_the_same_tokens(smolvlm_dir: Path, llm: LLM) -> None:
    """Steps launched ahead of the one before (async scheduling), 16 tokens a step: the image
    arrives over several steps and the answer is the synchronous engine's."""
    ahead = LLM(
        model=str(smolvlm_dir), dtype="float32", async_scheduling=True, max_num_batched_tokens=16
    )
    prompts = [{"prompt": TWO, "multi_modal_data": {"image": [picture(3), picture(4)]}}]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    (out,) = ahead.generate(prompts, params, use_tqdm=False)
    ahead.shutdown()
    (expected,) = llm.generate(prompts, params, use_tqdm=False)
    assert list(out.outputs[0].token_ids) == list(expected.outputs[0].token_ids)


def test_the_same_image_is_cached_through_and_another_stops_the_hit(llm: LLM) -> None:
    llm.reset_prefix_cache()
    first, cached = generate(llm, ONE, [picture(11)])
    assert cached == 0
    again, cached = generate(llm, ONE, [picture(11)])
    assert again == first
    (out,) = llm.generate({"prompt": ONE, "multi_modal_data": {"image": picture(11)}}, GREEDY)
    prompt_len = len(out.prompt_token_ids)
    assert out.num_cached_tokens == (prompt_len // 16) * 16  # every whole block
    start = ONE.index(IMAGE_TOKEN)  # the text before the image: the same tokens
    before = len(llm.get_tokenizer().encode(ONE[:start]))
    _, cached = generate(llm, ONE, [picture(12)])
    assert cached == (before // 16) * 16  # the blocks before the first the image touches


def test_preempted_image_requests_resume_to_the_same_tokens(smolvlm_dir: Path, llm: LLM) -> None:
    """Four image prompts of 94 tokens, 40 tokens each to generate, in 20 blocks: requests
    are preempted and recomputed, images and all; each answer is the one it gets alone."""
    prompts = [{"prompt": ONE, "multi_modal_data": {"image": picture(30 + i)}} for i in range(4)]
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    tight = LLM(model=str(smolvlm_dir), dtype="float32", num_gpu_blocks_override=20)
    together = tight.generate(prompts, params, use_tqdm=False)
    assert tight.get_stats().num_preemptions > 0
    tight.shutdown()
    for prompt, out in zip(prompts, together, strict=True):
        (alone,) = llm.generate(prompt, params, use_tqdm=False)
        assert list(out.outputs[0].token_ids) == list(alone.outputs[0].token_ids)


def test_llm_chat_takes_image_parts_as_generate_takes_the_rendered_prompt(llm: LLM) -> None:
    """`LLM.chat` with vLLM's `image_pil` and OpenAI's `image_url` (a data: URL of the same
    PNG): the tokens `generate` gives for the prompt the template renders."""
    import base64
    import io

    image = picture(8)
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    expected, _ = generate(llm, ONE, [image])
    for part in (
        {"type": "image_pil", "image_pil": image},
        {"type": "image_url", "image_url": {"url": url}},
    ):
        content = [part, {"type": "text", "text": "Describe the image."}]
        (out,) = llm.chat([{"role": "user", "content": content}], GREEDY, use_tqdm=False)
        assert list(out.outputs[0].token_ids) == expected
