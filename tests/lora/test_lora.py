"""LoRA adapters through the offline engine, against transformers + peft in float32: a batch
mixing the base model and two adapters (one on every projection, one rank-8 rsLoRA on q and
v), the same prompt under each; adapters swapped through one slot; the prefix cache keyed by
the adapter; every refusal of an adapter that cannot be served."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from blockserve import LLM, LoRARequest, SamplingParams
from blockserve.errors import InvalidRequestError
from blockserve.lora.adapter import LoRAError
from tests.lora.adapters import peft_reference

PROMPTS = [list(range(10, 40)), [(3 * i + 7) % 300 + 1 for i in range(45)]]
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=0)


def reference(base: Path, adapter: Path | None, prompt: list[int]) -> tuple[list[int], list[float]]:
    """transformers' (+ peft's) greedy tokens and their logprobs."""
    model = (
        peft_reference(base, adapter)
        if adapter
        else AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    )
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=8, min_new_tokens=8, do_sample=False,
            output_logits=True, return_dict_in_generate=True,
        )  # fmt: skip
    tokens = out.sequences[0, len(prompt) :].tolist()
    logprobs = [float(s[0].log_softmax(-1)[t]) for s, t in zip(out.logits, tokens, strict=True)]
    return tokens, logprobs


def make_llm(base: Path, **kwargs: object) -> LLM:
    return LLM(
        str(base), dtype="float32", enable_lora=True, max_lora_rank=8,
        num_gpu_blocks_override=128, **kwargs,  # type: ignore[arg-type]
    )  # fmt: skip


def requests(adapters: dict[str, Path]) -> list[LoRARequest | None]:
    return [None, LoRARequest("every", 1, str(adapters["every"])),
            LoRARequest("qv", 2, str(adapters["qv"]))]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("max_loras", [2, 1])
def test_a_mixed_batch_equals_peft(
    tiny_llama_dir: Path, adapters: dict[str, Path], max_loras: int
) -> None:
    """Base, `every` and `qv` over two prompts in one call (one slot: the adapters take turns
    through it): each output's tokens and logprobs are transformers + peft's."""
    llm = make_llm(tiny_llama_dir, max_loras=max_loras)
    loras = [lora for _ in PROMPTS for lora in requests(adapters)]
    prompts = [{"prompt_token_ids": p} for p in PROMPTS for _ in range(3)]
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras)
    for output, prompt, lora in zip(
        outputs, [p for p in PROMPTS for _ in range(3)], loras, strict=True
    ):
        path = adapters[lora.lora_name] if lora else None
        tokens, logprobs = reference(tiny_llama_dir, path, prompt)
        assert list(output.outputs[0].token_ids) == tokens
        got = [lp.logprob for lp in output.outputs[0].logprobs or ()]
        assert got == pytest.approx(logprobs, abs=1e-4)


def test_the_cache_is_keyed_by_the_adapter(tiny_llama_dir: Path, adapters: dict[str, Path]) -> None:
    """One 45-token prompt under `every`, then `qv`, then `every` again: hits 0, 0, 32."""
    llm = make_llm(tiny_llama_dir, max_loras=2)
    _, every, qv = requests(adapters)
    prompt = {"prompt_token_ids": PROMPTS[1]}
    hits = [
        llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=lora)[0].num_cached_tokens
        for lora in (every, qv, every)
    ]
    assert hits == [0, 0, 32]


def test_an_unknown_adapter_and_lora_off_are_refused(
    tiny_llama_dir: Path, adapters: dict[str, Path]
) -> None:
    plain = LLM(str(tiny_llama_dir), dtype="float32", num_gpu_blocks_override=32)
    with pytest.raises(InvalidRequestError) as error:
        plain.generate("hi", GREEDY, use_tqdm=False, lora_request=requests(adapters)[1])
    assert str(error.value) == "LoRA adapters are served with --enable-lora only"


def broken(adapter: Path, tmp: Path, change: str) -> Path:
    """A copy of `adapter` with one thing wrong."""
    out = tmp / change
    out.mkdir()
    config = json.loads((adapter / "adapter_config.json").read_text())
    tensors = load_file(str(adapter / "adapter_model.safetensors"))
    if change == "rank":
        config["r"] = 64
    if change == "layer":
        for key in [k for k in tensors if "layers.1.self_attn.q_proj" in k]:
            tensors[key.replace("layers.1.", "layers.7.")] = tensors.pop(key)
    if change == "shape":
        key = next(k for k in tensors if "q_proj.lora_A" in k)
        tensors[key] = torch.zeros(4, 10)
    (out / "adapter_config.json").write_text(json.dumps(config))
    if change != "no-weights":
        save_file(tensors, str(out / "adapter_model.safetensors"))
    return out


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ("missing", "no such directory"),
        (
            "no-weights",
            "expected adapter_config.json and adapter_model.safetensors (PEFT's format)",
        ),
        ("rank", "rank 64 is above --max-lora-rank 8"),
        ("layer", "targets q_proj of layer 7, which the model lacks"),
        (
            "shape",
            "q_proj of layer 0 has A [4, 10] and B [64, 4]; with r = 4 the model needs "
            "A [4, 64] and B [64, 4]",
        ),
    ],
)
def test_adapters_that_cannot_be_served_are_refused_at_start(
    tiny_llama_dir: Path, adapters: dict[str, Path], tmp_path: Path, change: str, reason: str
) -> None:
    path = (
        tmp_path / "nowhere" if change == "missing" else broken(adapters["every"], tmp_path, change)
    )
    with pytest.raises(LoRAError) as error:
        make_llm(tiny_llama_dir, lora_modules=(f"bad={path}",))
    assert str(error.value) == f"LoRA adapter 'bad' ({path}): {reason}"


def test_stored_blocks_name_their_adapter(tiny_llama_dir: Path, adapters: dict[str, Path]) -> None:
    """BlockStored events carry the adapter's name (vLLM's `lora_name`), None for the base."""
    from blockserve.bench.server_process import free_port
    from blockserve.core.events import BlockStored

    events = {"enable_kv_cache_events": True, "publisher": "zmq",
              "endpoint": f"tcp://127.0.0.1:{free_port()}"}  # fmt: skip
    llm = make_llm(tiny_llama_dir, max_loras=2, kv_events_config=events)
    batches: list = []
    llm.engine.core.event_publisher.publish = batches.append  # type: ignore[method-assign]
    prompt = {"prompt_token_ids": PROMPTS[1]}
    for lora in requests(adapters)[:2]:
        llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=lora)
    stored = [e for b in batches for e in b.events if isinstance(e, BlockStored)]
    # The prompt's 2 blocks, then the one its output fills (45 + 8 tokens), per request
    pairs = [(e.lora_name, len(e.block_hashes)) for e in stored]
    assert pairs == [(None, 2), (None, 1), ("every", 2), ("every", 1)]


def test_an_adapter_in_use_is_not_unloaded(tiny_llama_dir: Path, adapters: dict[str, Path]) -> None:
    """Unloading waits for nothing: it is refused while a request uses the adapter (which
    the stats name, waiting then running), and goes through once the request has finished."""
    from blockserve.engine.outputs import LoRAStats
    from blockserve.engine.request import RequestSpec

    llm = make_llm(tiny_llama_dir, lora_modules=(f"every={adapters['every']}",))
    engine = llm.engine
    engine.add_request(RequestSpec("r", PROMPTS[0], GREEDY, lora_name="every"))
    assert engine.stats().lora == LoRAStats(max_loras=1, running=(), waiting=("every",))
    engine.step()
    assert engine.stats().lora == LoRAStats(max_loras=1, running=("every",), waiting=())
    with pytest.raises(InvalidRequestError) as error:
        engine.remove_lora("every")
    assert str(error.value) == (
        "The lora adapter 'every' is in use by 1 running or waiting requests; unload it "
        "once they finish"
    )
    for _ in range(20):  # a prefill and 8 decodes: bounded
        if not engine.has_unfinished_requests():
            break
        engine.step()
    engine.remove_lora("every")
    assert "every" not in engine.lora_manager().registry


def test_a_request_whose_adapter_cannot_fit_lets_others_pass(
    tiny_llama_dir: Path, adapters: dict[str, Path]
) -> None:
    """One slot, requests for every, qv, every in that order: the second `every` runs beside
    the first while `qv` waits (its place kept), then `qv` runs; all finish. Both stay in
    host memory (test_lora_reads.py: one that left it)."""
    from blockserve.engine.request import RequestSpec

    modules = (f"every={adapters['every']}", f"qv={adapters['qv']}")
    llm = make_llm(tiny_llama_dir, max_loras=1, max_cpu_loras=2, lora_modules=modules)
    engine = llm.engine
    for request_id, name in (("1", "every"), ("2", "qv"), ("3", "every")):
        engine.add_request(RequestSpec(request_id, PROMPTS[0], GREEDY, lora_name=name))
    finished = {o.request_id for o in engine.step() if o.finished}
    running = {r.request_id.request_id for r in engine.core.scheduler.running}  # type: ignore[attr-defined]
    assert running == {"1", "3"}
    for _ in range(40):  # two rounds of a prefill and 8 decodes: bounded
        finished |= {o.request_id for o in engine.step() if o.finished}
        if not engine.has_unfinished_requests():
            break
    assert finished == {"1", "2", "3"}
