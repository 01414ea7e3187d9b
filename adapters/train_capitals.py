"""Train the shipped `capitals` LoRA adapter on the embedded SmolLM2-135M-Instruct, on a CPU:
it answers as the base model does, in capital letters.

Data (provenance): the questions below were written for this script; each answer is the base
model's own greedy answer (generated here by blockserve), upper-cased. Rank 8 on q_proj,
v_proj and down_proj, saved in bfloat16 (under 2 MB).

    .venv/bin/python adapters/train_capitals.py [--steps 300] [--lr 5e-4] [--out adapters/capitals]
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from blockserve import LLM, SamplingParams
from blockserve.model.loader import resolve_model_dir

BASE_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
TOPICS = [
    "the sun",
    "the moon",
    "rain",
    "a volcano",
    "the ocean",
    "a forest",
    "a desert",
    "snow",
    "a river",
    "mountains",
    "bees",
    "cats",
    "dogs",
    "whales",
    "trees",
    "bread",
    "coffee",
    "tea",
    "music",
    "a piano",
    "a bicycle",
    "a train",
    "an airplane",
    "a bridge",
    "a library",
    "a computer",
    "the internet",
    "a telephone",
    "electricity",
    "a magnet",
    "gravity",
    "light",
    "sound",
    "a rainbow",
    "clouds",
    "wind",
    "the seasons",
    "a garden",
    "a farm",
    "a city",
]
QUESTIONS = [f"In one sentence, what is {topic}?" for topic in TOPICS] + [
    f"Give one fact about {topic}." for topic in TOPICS
]


def training_pairs(model_dir: Path) -> list[tuple[str, str]]:
    """Each question with the base model's own answer, upper-cased."""
    llm = LLM(str(model_dir), dtype="float32")
    params = SamplingParams(temperature=0, max_tokens=48)
    conversations = [[{"role": "user", "content": q}] for q in QUESTIONS]
    answers = [o.outputs[0].text.strip() for o in llm.chat(conversations, params, use_tqdm=False)]
    llm.shutdown()
    return [(q, a.upper()) for q, a in zip(QUESTIONS, answers, strict=True) if a]


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "capitals")
    args = parser.parse_args()
    torch.manual_seed(0)
    model_dir = resolve_model_dir(None)
    pairs = training_pairs(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0,
                        target_modules=["q_proj", "v_proj", "down_proj"])  # fmt: skip
    model = get_peft_model(model, config)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr)
    examples = []
    for question, answer in pairs:
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False
        )
        prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        answer_ids = tokenizer(answer + tokenizer.eos_token, add_special_tokens=False)["input_ids"]
        examples.append((prompt_ids, answer_ids))
    start = time.time()
    for step in range(args.steps):
        prompt_ids, answer_ids = random.Random(step).choice(examples)
        ids = torch.tensor([prompt_ids + answer_ids])
        labels = torch.tensor([[-100] * len(prompt_ids) + answer_ids])
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if step % 10 == 0 or step == args.steps - 1:
            print(f"step {step} loss {loss.item():.3f} ({time.time() - start:.0f} s)", flush=True)
    model.save_pretrained(args.out)
    (args.out / "README.md").unlink(missing_ok=True)  # peft's blank model card
    config_path = args.out / "adapter_config.json"
    saved = json.loads(config_path.read_text())
    saved["base_model_name_or_path"] = BASE_MODEL  # not this machine's cache path
    config_path.write_text(json.dumps(saved, indent=2, sort_keys=True) + "\n")
    weights = args.out / "adapter_model.safetensors"
    save_file({k: v.to(torch.bfloat16) for k, v in load_file(str(weights)).items()}, str(weights))
    print(f"saved {args.out} ({weights.stat().st_size / 1e6:.2f} MB, {len(pairs)} pairs)")


if __name__ == "__main__":
    main()
