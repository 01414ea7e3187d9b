"""Structured outputs on this CPU: llguidance against xgrammar, and what a mask costs a batch.

Sections:
  backends  Both grammar engines on the default model's tokenizer (SmolLM2, 49,152 tokens):
            whether a string with maxLength stays strict JSON (does the engine accept a raw
            control character inside it?), the one-off vocabulary scan, compiling a nested
            JSON schema (cold; then again, warm),
            and the per-token work of constraining one row: filling the next-token bitmask while
            the engine walks a 57-token JSON document that fits the schema (median, p99 and max
            over --repeats walks), and applying each of those masks to one row of logits
            (xgrammar's CPU kernel, blockserve's tensor unpacking, llguidance's torch code).
  sampler   The runner's sampling step on a batch of --rows rows of real-width logits: the
            sampler alone (temperature 0.8, no top-p/top-k), then `apply_token_masks` + sampler
            with 0, 1 and all rows constrained (median µs per step over --steps steps). The
            0-row figure is the price every unconstrained batch pays.
  whitespace  The default model asked for a JSON object (json_object, n=20, seed 0,
            temperature 0.7, max_tokens 256, float32) under each
            --structured-outputs-max-whitespace setting: how many samples close their object
            (finish "stop") and parse, their median length, and the first sample's text.

    .venv/bin/python benchmarks/bench_structured_outputs.py [--section backends sampler whitespace]
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from report import emit

from blockserve.grammar import GrammarCompiler, apply_token_masks, mask_rows
from blockserve.model.loader import resolve_model_dir
from blockserve.model.sampler import Sampler, SamplingBatch, SamplingRow
from blockserve.sampling_params import SamplingParams, StructuredOutputsParams

SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 40},
        "year": {"type": "integer"},
        "author": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 40},
                "country": {"enum": ["UK", "US", "FR", "other"]},
            },
            "required": ["name", "country"],
        },
        "genre": {"enum": ["fiction", "history", "science"]},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
    },
    "required": ["title", "year", "author", "genre", "tags"],
    "additionalProperties": False,
}
# A string with maxLength; strict JSON forbids a raw control character inside it.
BOUNDED = {"type": "string", "maxLength": 20}


def control_char_prefix(tokenizer: Any) -> list[int]:
    """Token ids of `"ab` and then the byte 0x13 (byte-level BPE spells byte b < 0x21 as the
    character U+0100 + b; the tokenizer's encode drops control characters, hence by hand)."""
    return [
        *tokenizer.encode('"ab', add_special_tokens=False),
        tokenizer.convert_tokens_to_ids(chr(0x113)),
    ]


DOCUMENT = (
    '{"title": "The Voyage Out", "year": 1915, "author": {"name": "Virginia Woolf", '
    '"country": "UK"}, "genre": "fiction", "tags": ["novel", "modernist", "sea"]}'
)


def micros(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {
        "median_us": round(statistics.median(ordered) * 1e6, 2),
        "p99_us": round(ordered[min(int(0.99 * len(ordered)), len(ordered) - 1)] * 1e6, 2),
        "max_us": round(ordered[-1] * 1e6, 2),
    }


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    start = time.perf_counter()
    value = fn()
    return value, time.perf_counter() - start


def bench_xgrammar(tokenizer: Any, vocab: int, ids: list[int], repeats: int) -> dict[str, Any]:
    import xgrammar

    info, scan = timed(lambda: xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab))
    compiler = xgrammar.GrammarCompiler(info, max_threads=1)
    text = json.dumps(SCHEMA)
    compiled, cold = timed(lambda: compiler.compile_json_schema(text))
    _, warm = timed(lambda: compiler.compile_json_schema(text))
    bounded = compiler.compile_json_schema(json.dumps(BOUNDED))
    matcher = xgrammar.GrammarMatcher(bounded)
    control = all(matcher.accept_token(t) for t in control_char_prefix(tokenizer))
    fills: list[float] = []
    applies: list[float] = []
    unpacks: list[float] = []
    bitmask = xgrammar.allocate_token_bitmask(1, vocab)
    base = torch.randn(1, vocab)
    for _ in range(repeats):
        matcher = xgrammar.GrammarMatcher(compiled)
        for token in ids:
            _, seconds = timed(lambda m=matcher: m.fill_next_token_bitmask(bitmask))
            fills.append(seconds)
            assert matcher.accept_token(token)
            # The same mask applied by xgrammar's CPU kernel and by blockserve's unpacking.
            logits = base.clone()
            applies.append(
                timed(lambda x=logits: xgrammar.apply_token_bitmask_inplace(x, bitmask))[1]
            )
            ours = base.clone()
            unpacks.append(timed(lambda x=ours: mask_rows(x, bitmask, [0]))[1])
            assert torch.equal(logits, ours)
    return {
        "version": importlib.metadata.version("xgrammar"),
        "accepts_raw_control_char_in_bounded_string": bool(control),
        "vocabulary_scan_s": round(scan, 3),
        "compile_cold_ms": round(cold * 1e3, 2),
        "compile_warm_ms": round(warm * 1e3, 3),
        "fill_mask": micros(fills),
        "apply_mask": micros(applies),
        "apply_mask_blockserve_unpack": micros(unpacks),
    }


def bench_llguidance(tokenizer: Any, vocab: int, ids: list[int], repeats: int) -> dict[str, Any]:
    import llguidance
    import llguidance.hf
    import llguidance.torch

    info, scan = timed(lambda: llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab))
    grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA)
    matcher, cold = timed(lambda: llguidance.LLMatcher(info, grammar))
    _, warm = timed(lambda: llguidance.LLMatcher(info, grammar))
    assert not matcher.is_error(), matcher.get_error()
    bounded = llguidance.LLMatcher(
        info, llguidance.LLMatcher.grammar_from_json_schema(BOUNDED), log_level=0
    )
    control = all(bounded.consume_token(t) for t in control_char_prefix(tokenizer))
    fills: list[float] = []
    applies: list[float] = []
    bitmask = llguidance.torch.allocate_token_bitmask(1, vocab)
    base = torch.randn(1, vocab)
    llguidance.torch.apply_token_bitmask_inplace(base.clone(), bitmask)  # first call: set-up
    for _ in range(repeats):
        matcher = llguidance.LLMatcher(info, grammar)
        for token in ids:
            _, seconds = timed(
                lambda m=matcher: llguidance.torch.fill_next_token_bitmask(m, bitmask, 0)
            )
            fills.append(seconds)
            assert matcher.consume_token(token), matcher.get_error()
            logits = base.clone()
            applies.append(
                timed(lambda x=logits: llguidance.torch.apply_token_bitmask_inplace(x, bitmask))[1]
            )
    return {
        "version": importlib.metadata.version("llguidance"),
        "accepts_raw_control_char_in_bounded_string": control,
        "vocabulary_scan_s": round(scan, 3),
        "compile_cold_ms": round(cold * 1e3, 2),
        "compile_warm_ms": round(warm * 1e3, 3),
        "fill_mask": micros(fills),
        "apply_mask": micros(applies),
    }


def backends(tokenizer: Any, vocab: int, repeats: int) -> dict[str, Any]:
    ids = list(tokenizer.encode(DOCUMENT, add_special_tokens=False))
    return {
        "document_tokens": len(ids),
        "llguidance": bench_llguidance(tokenizer, vocab, ids, repeats),
        "xgrammar": bench_xgrammar(tokenizer, vocab, ids, repeats),
    }


def sampler_step(tokenizer: Any, vocab: int, rows: int, steps: int) -> dict[str, Any]:
    """µs per sampling step (mask + sample) with 0, 1 and `rows` constrained rows."""
    compiler = GrammarCompiler(tokenizer, vocab, [tokenizer.eos_token_id])
    params = StructuredOutputsParams(json=SCHEMA)
    compiler.compile(params)  # the vocabulary scan and compile are not the step's
    sampler = Sampler(torch.Generator().manual_seed(0))
    sampling = SamplingParams(temperature=0.8)
    batch = SamplingBatch.build(
        [SamplingRow(sampling, (1,), (), None) for _ in range(rows)], vocab, torch.device("cpu")
    )
    base = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(1))
    results: dict[str, Any] = {"rows": rows}

    def run(constrained: int | None) -> float:
        times = []
        count = constrained or 0
        matchers = [compiler.matcher(params) if i < count else None for i in range(rows)]
        for _ in range(steps):
            logits = base.clone()
            start = time.perf_counter()
            if constrained is not None:
                apply_token_masks(logits, matchers)
            out = sampler(logits, batch)
            elapsed = time.perf_counter() - start
            times.append(elapsed)
            for i in range(count):
                matcher = matchers[i]
                assert matcher is not None and matcher.consume_token(int(out.token_ids[i]))
                if matcher.is_stopped():  # the document ended: start another
                    matchers[i] = compiler.matcher(params)
        return statistics.median(times) * 1e6

    results["sampler_alone_us"] = round(run(None), 1)
    for constrained in (0, 1, rows):
        results[f"constrained_{constrained}_us"] = round(run(constrained), 1)
    return results


def whitespace(settings: tuple[int, ...] = (0, 2, 4, 16, -1)) -> list[dict[str, Any]]:
    from blockserve import LLM, SamplingParams
    from blockserve.sampling_params import StructuredOutputsParams

    messages = [{"role": "user", "content": "Reply with a JSON object with a name and an age."}]
    params = SamplingParams(
        n=20, seed=0, temperature=0.7, max_tokens=256,
        structured_outputs=StructuredOutputsParams(json_object=True),
    )  # fmt: skip
    rows = []
    for max_whitespace in settings:
        llm = LLM(
            dtype="float32", max_model_len=2048, structured_outputs_max_whitespace=max_whitespace
        )
        (result,) = llm.chat([messages], params, use_tqdm=False)
        llm.shutdown()
        stopped = [o for o in result.outputs if o.finish_reason == "stop"]
        parsed = 0
        for output in stopped:
            with contextlib.suppress(ValueError):
                parsed += isinstance(json.loads(output.text), dict)
        rows.append(
            {
                "max_whitespace": max_whitespace,
                "samples": len(result.outputs),
                "stopped": len(stopped),
                "parsed": parsed,
                "median_tokens": statistics.median(len(o.token_ids) for o in result.outputs),
                "first": result.outputs[0].text,
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--section", nargs="+", default=["backends", "sampler"])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("benchmarks/results/structured_outputs/structured_outputs.json"),
    )
    args = parser.parse_args()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model_dir(None)))
    vocab = len(tokenizer)
    results: dict[str, Any] = {
        "machine": platform.processor() or platform.machine(),
        "torch_threads": torch.get_num_threads(),
        "model": "SmolLM2-135M-Instruct tokenizer",
        "vocab_size": vocab,
    }
    if "backends" in args.section:
        results["backends"] = backends(tokenizer, vocab, args.repeats)
    if "sampler" in args.section:
        results["sampler"] = sampler_step(tokenizer, vocab, args.rows, args.steps)
    if "whitespace" in args.section:
        results["whitespace"] = whitespace()
    emit(results, args.out)


if __name__ == "__main__":
    main()
