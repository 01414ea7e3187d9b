"""Time to first token when an image's KV blocks are gone but the encoder cache holds its tower
output, against the same load with the encoder cache off (`--encoder-cache-size 0`). The test
SmolVLM at SmolVLM-256M's vision shape (bench_images.py), two 640 x 480 images (13 tiles, 832
embeddings each: the default cache, 2,048 embeddings, holds both) asked about in turn, A, B,
A, B, ..., in a KV cache of 64 blocks, so that each prompt (about 880 tokens) evicts the other
image's blocks: every turn misses the prefix cache from the image on. Medians of the turns
after each image's first.

    .venv/bin/python benchmarks/bench_encoder_cache.py [--turns 4] [--dtype auto] [--out FILE]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_images import SMOLVLM_256M_VISION, ttft
from report import emit

from blockserve import LLM
from tests.multimodal.images import pixels
from tests.multimodal.smolvlm_model import save_test_smolvlm

QUESTIONS = ("What is in this image?", "What colours does it have?", "Is it a photo?")
KV_BLOCKS = 64


def run(model: Path, dtype: str, turns: int, encoder_cache_size: int | None) -> dict[str, Any]:
    from PIL import Image

    llm = LLM(
        model=str(model),
        dtype=dtype,
        num_gpu_blocks_override=KV_BLOCKS,
        encoder_cache_size=encoder_cache_size,
    )
    images = [Image.fromarray(pixels(200 + i, 480, 640, 3)) for i in range(2)]
    samples = []
    for turn in range(turns):
        for image in images:
            seconds, prompt_tokens, cached = ttft(llm, image, QUESTIONS[turn % len(QUESTIONS)])
            samples.append({"turn": turn, "ttft_s": round(seconds, 4), "cached": cached})
    encoded = llm.engine.stats().images
    llm.shutdown()
    later = [s["ttft_s"] for s in samples if s["turn"] > 0]
    return {
        "encoder_cache_size": encoder_cache_size,
        "requests": samples,
        "prompt_tokens": prompt_tokens,
        "images_encoded": None if encoded is None else encoded.encoded_images,
        "later_turns_ttft_p50_s": round(statistics.median(later), 4),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        model = save_test_smolvlm(Path(folder), SMOLVLM_256M_VISION, scale=4)
        on = run(model, args.dtype, args.turns, None)
        off = run(model, args.dtype, args.turns, 0)
    emit(
        {
            "benchmark": "encoder_cache",
            "model": "test SmolVLM: SmolLM2-135M text half, SmolVLM-256M vision shape (random)",
            "dtype": args.dtype,
            "kv_blocks": KV_BLOCKS,
            "cache_on": on,
            "cache_off": off,
            "on_over_off": round(on["later_turns_ttft_p50_s"] / off["later_turns_ttft_p50_s"], 4),
        },
        args.out,
    )


if __name__ == "__main__":
    main()
