"""The Triton kernels equal the torch backend (on the CPU: under TRITON_INTERPRET=1, in
float32 and float16; the interpreter computes bfloat16 wrongly)."""

from __future__ import annotations

import pytest
import torch

from blockserve.attention.torch_backend import TorchAttentionBackend
from blockserve.attention.triton_backend import (
    TritonAttentionBackend,
    reshape_and_cache,
    unified_attention,
)
from blockserve.attention.triton_plan import TritonAttentionPlan, choose_num_splits, plan_launch
from tests.attention.cases import AttentionCase, make_bench_case, make_case, reference_attention

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Fresh prefill, decodes, prefills on prefixes of 37, 5 and 109 tokens (not multiples of 16).
# Split, the last prefill's tiles straddle a split boundary: some of their queries see no key
# in the last split.
MIXED = [(0, 23), (37, 1), (16, 9), (5, 30), (50, 1), (109, 21)]
# Decodes only, over contexts that span several 64-key tiles (and, split, some empty splits).
DECODES = [(200, 1), (3, 1), (130, 1), (64, 1)]
TOLERANCE = {torch.float32: 2e-5, torch.float16: 2e-3}


def check_against_torch(case: AttentionCase, dtype: torch.dtype, num_splits: int) -> None:
    """Run the Triton kernels on `case` (poisoned output) and compare with the torch backend
    and the float64 reference; both backends must write the same K/V."""
    torch_cache = case.kv_cache.clone()
    plan = TritonAttentionBackend().prepare(case.metadata)
    reshape_and_cache(case.key, case.value, case.kv_cache, case.metadata.slot_mapping)
    out = torch.full_like(case.query, float("nan"))  # poisoned: unwritten elements fail
    unified_attention(case.query, case.kv_cache, plan, out, num_splits=num_splits)
    torch_backend = TorchAttentionBackend()
    expected = torch_backend.forward(
        case.query, case.key, case.value, torch_cache, torch_backend.prepare(case.metadata)
    )
    assert not torch.isnan(out).any()
    assert (out.float() - expected.float()).abs().max().item() < TOLERANCE[dtype]
    reference = reference_attention(case)
    assert (out.double().cpu() - reference).abs().max().item() < TOLERANCE[dtype] * 2
    assert torch.equal(case.kv_cache, torch_cache)


@pytest.mark.slow
@pytest.mark.parametrize("num_splits", [1, 4])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(6, 2), (8, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_unified_attention_matches_torch_backend(
    num_heads: int, num_kv_heads: int, dtype: torch.dtype, num_splits: int
) -> None:
    """Mixed prefill-on-prefix and decode, GQA 3:1 and 4:1, head_dim 64, unsplit and split
    four ways: equal within tolerance."""
    case = make_case(MIXED, num_heads, num_kv_heads, head_dim=64, dtype=dtype, seed=7)
    check_against_torch(case.to(DEVICE), dtype, num_splits)


@pytest.mark.slow
@pytest.mark.parametrize("num_splits", [1, 2, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_decode_batches_match_torch_backend(dtype: torch.dtype, num_splits: int) -> None:
    """Decodes over contexts of 3 to 201 tokens, with a shared prefix, GQA 4:1: unsplit, split
    in two, and split eight ways (the 4-token context leaves most splits empty)."""
    case = make_case(DECODES, 8, 2, head_dim=64, dtype=dtype, shared_blocks=2, seed=3)
    check_against_torch(case.to(DEVICE), dtype, num_splits)


def test_launch_shape_packs_grouped_heads() -> None:
    """Decode-only steps pack the heads sharing a KV head into one 16-row tile, one tile per
    sequence; a step with a long query uses 64-row tiles of 64 / queries_per_kv tokens."""
    decodes = make_case(DECODES, 8, 2, head_dim=64).metadata
    shape = plan_launch(decodes, queries_per_kv=4, num_kv_heads=2)
    assert (shape.block_m, shape.block_q, shape.num_splits) == (16, 4, 1)
    assert shape.tile_seq.tolist() == [0, 1, 2, 3]
    assert shape.tile_offset.tolist() == [0, 0, 0, 0]
    mixed = make_case(MIXED, 6, 2, head_dim=64).metadata
    shape = plan_launch(mixed, queries_per_kv=3, num_kv_heads=2)
    assert (shape.block_m, shape.block_q) == (64, 21)
    assert shape.tile_seq.tolist() == [0, 0, 1, 2, 3, 3, 4, 5]
    assert shape.tile_offset.tolist() == [0, 21, 0, 0, 0, 21, 0, 0]
    plan = TritonAttentionPlan(mixed)
    assert plan.launch_shape(3, 2) is plan.launch_shape(3, 2)  # once per step, every layer
    scratch = plan.split_scratch(4, 6, 64, torch.device("cpu"))
    assert [tuple(t.shape) for t in scratch] == [(4, 85, 6, 64), (4, 85, 6), (4, 85, 6)]
    assert plan.split_scratch(4, 6, 64, torch.device("cpu")) is scratch
    with pytest.raises(ValueError, match="power of two"):
        plan_launch(mixed, queries_per_kv=3, num_kv_heads=2, num_splits=3)


@pytest.mark.slow
def test_layers_of_one_step_share_the_plan_and_its_scratch() -> None:
    """Two layers (their own queries and caches, the step's one metadata) attended through one
    plan, split four ways: the second reuses the first's scratch and still equals the torch
    backend."""
    case = make_case(DECODES, 8, 2, head_dim=64, seed=1).to(DEVICE)
    plan = TritonAttentionBackend().prepare(case.metadata)
    torch_backend = TorchAttentionBackend()
    for layer in range(2):
        query, kv_cache = case.query * (layer + 1), case.kv_cache.flip(-1).clone() * (layer + 1)
        expected = torch_backend.forward(
            query, case.key, case.value, kv_cache.clone(), torch_backend.prepare(case.metadata)
        )
        reshape_and_cache(case.key, case.value, kv_cache, case.metadata.slot_mapping)
        out = torch.full_like(query, float("nan"))
        unified_attention(query, kv_cache, plan, out, num_splits=4)
        assert (out - expected).abs().max().item() < TOLERANCE[torch.float32]
    assert len(plan.scratch) == 1


def test_reshape_and_cache_writes_only_the_slots() -> None:
    """Each token's K/V lands at its slot; every other cache element is unchanged."""
    case = make_case([(3, 5), (20, 1)], 4, 2, head_dim=64, seed=2).to(DEVICE)
    before = case.kv_cache.clone()
    reshape_and_cache(case.key, case.value, case.kv_cache, case.metadata.slot_mapping)
    flat = case.kv_cache.view(2, -1, 2, 64)
    slots = case.metadata.slot_mapping
    assert torch.equal(flat[0, slots], case.key)
    assert torch.equal(flat[1, slots], case.value)
    untouched = torch.ones(flat.shape[1], dtype=torch.bool, device=flat.device)
    untouched[slots] = False
    assert torch.equal(flat[:, untouched], before.view(2, -1, 2, 64)[:, untouched])


@pytest.mark.slow
def test_greedy_generation_with_triton_equals_torch(tiny_llama_dir: object) -> None:
    """The tiny model (GQA 2:1, head_dim 16) generates the same greedy tokens through the
    engine with the triton backend (interpreted on the CPU) as with the torch backend, over
    prompts with prefix-cache hits, chunked prefill and decodes in one batch."""
    from blockserve import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    shared = list(range(5, 37))
    prompts = [[*shared, 40, 41, 42], [*shared, 50], list(range(60, 130))]
    outputs = {}
    for backend_name in ("torch", "triton"):
        llm = LLM(
            str(tiny_llama_dir),
            dtype="float32",
            device=DEVICE,
            attention_backend=backend_name,
            num_gpu_blocks_override=64,
            max_num_batched_tokens=64,
        )
        llm.generate(prompts[:1], params, use_tqdm=False)  # caches the shared prefix
        results = llm.generate(prompts, params, use_tqdm=False)
        outputs[backend_name] = [r.outputs[0].token_ids for r in results]
        assert llm.get_stats().prefix_cache_hits == 64  # 2 shared blocks x 2 prompts
    assert outputs["triton"] == outputs["torch"]
    assert [len(tokens) for tokens in outputs["torch"]] == [6, 6, 6]


def test_benchmark_cases_are_consistent() -> None:
    """benchmarks/bench_attention.py's device-built cases: each sequence owns distinct blocks,
    each new token's slot lies in its own sequence's block at its position, and the triton
    kernels agree with the torch backend on them (float32)."""
    specs = [(37, 1), (5, 20), (0, 16)]
    query, key, value, kv_cache, metadata = make_bench_case(
        specs, 8, 2, 64, device=DEVICE, dtype=torch.float32
    )
    tables = metadata.block_tables.tolist()
    owned = [tables[0][:3], tables[1][:2], tables[2][:1]]
    assert sorted(b for blocks in owned for b in blocks) == list(range(1, 7))
    expected_slots = [owned[0][37 // 16] * 16 + 37 % 16]
    expected_slots += [owned[1][p // 16] * 16 + p % 16 for p in range(5, 25)]
    expected_slots += [owned[2][0] * 16 + p for p in range(16)]
    assert metadata.slot_mapping.tolist() == expected_slots
    torch_cache = kv_cache.clone()
    backend = TritonAttentionBackend()
    out = backend.forward(query, key, value, kv_cache, backend.prepare(metadata))
    torch_backend = TorchAttentionBackend()
    expected = torch_backend.forward(
        query, key, value, torch_cache, torch_backend.prepare(metadata)
    )
    assert (out - expected).abs().max().item() < TOLERANCE[torch.float32]
    assert torch.equal(kv_cache, torch_cache)


def test_splits_fill_an_under_occupied_device() -> None:
    """On a 132-multiprocessor device (H100/H200) with 64-key tiles: one 8k decode over 8 KV
    heads splits 32 ways (the cap); 512 programs need no split; 128 programs split in two (the
    largest power of two <= 3); a 300-token context splits at most in two (two tiles each)."""
    assert choose_num_splits(8, 8193, 64, 132) == 32
    assert choose_num_splits(512, 8193, 64, 132) == 1
    assert choose_num_splits(128, 8193, 64, 132) == 2
    assert choose_num_splits(8, 300, 64, 132) == 2
    assert choose_num_splits(8, 100, 64, 132) == 1


def test_a_decode_graph_plan_over_padded_rows_equals_the_step_plan() -> None:
    """Four decodes loaded into a bucket of 8 static rows: the graph's plan (shapes and
    scratch made up front, planned for a 512-token context) gives the real rows the step
    plan's output; the padding rows read only the null block."""
    from blockserve.runner.decode_graphs import StaticDecodeInputs
    from blockserve.runner.inputs import ModelInputs

    case = make_case(DECODES, 8, 2, head_dim=64, seed=5).to(DEVICE)
    metadata = case.metadata
    reshape_and_cache(case.key, case.value, case.kv_cache, metadata.slot_mapping)
    expected = torch.full_like(case.query, float("nan"))
    unified_attention(
        case.query, case.kv_cache, TritonAttentionBackend().prepare(metadata), expected
    )
    static = StaticDecodeInputs(
        max_batch=8, max_blocks=32, block_size=metadata.block_size, device=case.query.device
    )
    static.load(
        ModelInputs(
            input_ids=torch.zeros(4, dtype=torch.int64, device=DEVICE),
            positions=metadata.seq_lens - 1,
            metadata=metadata,
            sample_indices=torch.arange(4, device=DEVICE),
        ),
        bucket=8,
    )
    plan = TritonAttentionBackend().prepare_decode_graph(static.metadata(8), 8, 2, 64)
    assert len(plan.shapes) == 1 and len(plan.scratch) == 1  # nothing left to make
    query = torch.cat([case.query, torch.zeros_like(case.query)])
    out = torch.full_like(query, float("nan"))
    unified_attention(query, case.kv_cache, plan, out)
    assert torch.equal(out[:4], expected)
    assert not torch.isnan(out[4:]).any()


@pytest.mark.slow
def test_warm_up_launches_every_variant_and_writes_nothing() -> None:
    """Decode and prefill tiles, times 1, 2 and 4 splits (a 512-token context's choices)."""
    case = make_case(DECODES, 8, 2, head_dim=64, seed=6).to(DEVICE)
    before = case.kv_cache.clone()
    launches = TritonAttentionBackend().warm_up(case.kv_cache, 8, max_model_len=512)
    assert launches == 6
    assert torch.equal(case.kv_cache, before)


def test_the_kv_write_reads_views_of_the_fused_qkv_in_place() -> None:
    """K and V as the model hands them (views into one [tokens, q + k + v] row) are written
    without a copy, exactly as their packed copies are."""
    from blockserve.attention.triton_backend import packed_rows

    case = make_case([(3, 5), (20, 1)], 4, 2, head_dim=64, seed=4).to(DEVICE)
    tokens = case.key.shape[0]
    qkv = torch.cat([case.query, case.key, case.value], dim=1).view(tokens, -1)
    key = qkv[:, 4 * 64 : 6 * 64].view(tokens, 2, 64)
    value = qkv[:, 6 * 64 :].view(tokens, 2, 64)
    assert packed_rows(key).data_ptr() == key.data_ptr() and not key.is_contiguous()
    expected = case.kv_cache.clone()
    reshape_and_cache(case.key, case.value, expected, case.metadata.slot_mapping)
    reshape_and_cache(
        packed_rows(key), packed_rows(value), case.kv_cache, case.metadata.slot_mapping
    )
    assert torch.equal(case.kv_cache, expected)
    strided = case.key.transpose(0, 1).contiguous().transpose(0, 1)  # heads not packed
    assert packed_rows(strided).is_contiguous() and torch.equal(packed_rows(strided), case.key)
