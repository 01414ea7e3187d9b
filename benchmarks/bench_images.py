"""Time to first token of a second question about the same image, against the first: the test
SmolVLM at SmolVLM-256M's real vision shape (SigLIP-base/16 over 512-pixel tiles, 4 x 4 patches
a token; random weights, SmolLM2-135M's real text half), one 640 x 480 image (4 x 3 tiles and
the global image: 13 tiles, 832 image tokens). The first question runs the tower and prefills
the image; the second finds every whole block of the image cached and runs neither. Medians of
`--repeats` rounds, each on a fresh image.

    .venv/bin/python benchmarks/bench_images.py [--repeats 3] [--dtype auto|float32] [--out FILE]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from report import emit

from blockserve import LLM, SamplingParams
from tests.multimodal.images import pixels
from tests.multimodal.smolvlm_model import save_test_smolvlm

# SmolVLM-256M-Instruct's vision_config and scale factor.
SMOLVLM_256M_VISION = {
    "hidden_size": 768,
    "intermediate_size": 3072,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "patch_size": 16,
    "image_size": 512,
}
QUESTIONS = ("What is in this image?", "What colours does it have?")


def ttft(llm: LLM, image: Any, question: str) -> tuple[float, int, int]:
    """Seconds to the first token, prompt tokens, cached tokens."""
    prompt = f"<|im_start|>User:<image>{question}<end_of_utterance>\nAssistant:"
    request = {"prompt": prompt, "multi_modal_data": {"image": image}}
    started = time.perf_counter()
    (out,) = llm.generate(request, SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
    return time.perf_counter() - started, len(out.prompt_token_ids), out.num_cached_tokens or 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    from PIL import Image

    with tempfile.TemporaryDirectory() as folder:
        model = save_test_smolvlm(Path(folder), SMOLVLM_256M_VISION, scale=4)
        llm = LLM(model=str(model), dtype=args.dtype)
        llm.generate(
            {"prompt": "<image>hi", "multi_modal_data": {"image": Image.new("RGB", (32, 32))}},
            SamplingParams(max_tokens=1),
            use_tqdm=False,
        )
        rounds = []
        for seed in range(args.repeats):
            image = Image.fromarray(pixels(100 + seed, 480, 640, 3))
            first, prompt_tokens, _ = ttft(llm, image, QUESTIONS[0])
            second, second_tokens, cached = ttft(llm, image, QUESTIONS[1])
            rounds.append(
                {
                    "first_s": round(first, 4),
                    "second_s": round(second, 4),
                    "prompt_tokens": prompt_tokens,
                    "second_prompt_tokens": second_tokens,
                    "second_cached": cached,
                }
            )
    first_s = statistics.median(r["first_s"] for r in rounds)
    second_s = statistics.median(r["second_s"] for r in rounds)
    emit(
        {
            "benchmark": "images",
            "model": "test SmolVLM: SmolLM2-135M text half, SmolVLM-256M vision shape (random)",
            "dtype": args.dtype,
            "image": "640 x 480, 13 tiles",
            "rounds": rounds,
            "first_ttft_s": round(first_s, 4),
            "second_ttft_s": round(second_s, 4),
            "second_over_first": round(second_s / first_s, 4),
        },
        args.out,
    )


if __name__ == "__main__":
    main()
