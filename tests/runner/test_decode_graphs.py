"""Decode graphs without CUDA: the batch sizes captured, the static inputs and their padding,
and the engine's greedy tokens through the graphs' path (replayed by running again over the
same static buffers, the triton kernels interpreted) equal to the eager path's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from blockserve.runner.decode_graphs import (
    DecodeGraphs,
    EagerCapture,
    StaticDecodeInputs,
    bucket_for,
    graph_batch_sizes,
)
from blockserve.runner.inputs import ModelInputs, prepare_inputs
from blockserve.sched.output import ScheduledRequest, SchedulerOutput

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_batch_sizes_are_vllms_unless_given() -> None:
    assert graph_batch_sizes(256) == (1, 2, 4, *range(8, 257, 8))
    assert len(graph_batch_sizes(256)) == 35
    assert graph_batch_sizes(20) == (1, 2, 4, 8, 16)
    assert graph_batch_sizes(64, (48, 3, 500, 3, 1)) == (1, 3, 48)
    assert graph_batch_sizes(2, (4, 8)) == ()


def test_a_batch_takes_the_smallest_bucket_that_holds_it() -> None:
    sizes = graph_batch_sizes(20)
    assert [bucket_for(n, sizes) for n in (1, 2, 3, 4, 5, 8, 9, 16, 17)] == [
        1, 2, 4, 4, 8, 8, 16, 16, None,
    ]  # fmt: skip


def test_static_inputs_copy_the_rows_and_pad_the_bucket() -> None:
    tables = ((1,), (3, 4), (5, 6, 7))
    decodes = SchedulerOutput(
        tuple(
            ScheduledRequest(
                request_id=str(i),
                token_ids=(100 + i,),
                num_computed_tokens=16 * i + 3,
                block_ids=table,
                sample=True,
            )
            for i, table in enumerate(tables)
        )
    )
    inputs = prepare_inputs(decodes, 16, torch.device("cpu"))
    static = StaticDecodeInputs(
        max_batch=8, max_blocks=4, block_size=16, device=torch.device("cpu")
    )
    static.block_tables.fill_(77)  # a previous step's rows
    static.load(inputs, bucket=4)
    assert static.input_ids[:4].tolist() == [100, 101, 102, 0]
    assert static.positions[:4].tolist() == [3, 19, 35, 0]
    assert static.slot_mapping[:4].tolist() == [16 + 3, 4 * 16 + 3, 7 * 16 + 3, 0]
    assert static.seq_lens[:4].tolist() == [4, 20, 36, 1]
    assert static.block_tables[:4].tolist() == [
        [1, 0, 0, 77],
        [3, 4, 0, 77],
        [5, 6, 7, 77],
        [0, 0, 0, 0],
    ]  # past a row's step width the kernel reads nothing; the padding row: the null block
    assert static.block_tables[4:].unique().tolist() == [77]  # past the bucket: untouched
    metadata = static.metadata(4)
    assert metadata.query_start_loc.tolist() == [0, 1, 2, 3, 4]
    assert metadata.query_lens_cpu == (1, 1, 1, 1)
    assert metadata.seq_lens_cpu == (64, 64, 64, 64)  # planned for the longest context


@pytest.mark.slow
@pytest.mark.parametrize("num_prompts", [3, 8])
def test_greedy_tokens_through_the_graphs_equal_the_eager_path(
    tiny_llama_dir: Path, num_prompts: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """3 prompts decode in the bucket of 4 (one padding row), 8 fill theirs; every decode
    step after the prompts' is replayed. The engine captures them at start-up, as on CUDA,
    with a capture that runs on any device."""
    from blockserve import LLM, SamplingParams
    from blockserve.runner import start

    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    prompts = [list(range(5 + 7 * i, 5 + 7 * i + 9 + 5 * i)) for i in range(num_prompts)]
    outputs = {}
    for graphs in (False, True):
        if graphs:
            monkeypatch.setattr(start, "graph_capture", lambda device: EagerCapture())
        llm = LLM(
            str(tiny_llama_dir),
            dtype="float32",
            device=DEVICE,  # on the CPU: the kernels interpreted (tests/attention/conftest.py)
            attention_backend="triton",
            num_gpu_blocks_override=64,
            max_num_seqs=8,
            enforce_eager=not graphs,
        )
        decode_graphs = llm.engine.core.runner.decode_graphs
        assert (decode_graphs is not None) == graphs
        replayed: list[bool] = []
        if decode_graphs is not None:
            assert decode_graphs.sizes == (1, 2, 4, 8)
            assert llm.engine.core.info.runtime["cuda_graphs"] == 4
            replayed = count_replays(decode_graphs)
        results = llm.generate(prompts, params, use_tqdm=False)
        outputs[graphs] = [r.outputs[0].token_ids for r in results]
        # One prefill step (eager), then four decode steps (replayed).
        assert replayed == ([False, True, True, True, True] if graphs else [])
        llm.shutdown()
    assert outputs[True] == outputs[False]
    assert [len(tokens) for tokens in outputs[True]] == [5] * num_prompts


def count_replays(graphs: DecodeGraphs) -> list[bool]:
    """Per step from now on, whether `graphs` held it."""
    replayed: list[bool] = []
    run = graphs.run

    def counted(inputs: ModelInputs) -> torch.Tensor | None:
        hidden = run(inputs)
        replayed.append(hidden is not None)
        return hidden

    graphs.run = counted  # type: ignore[method-assign]
    return replayed


class FailingCapture:
    """A capture the device refuses (as CUDA refuses an op that syncs during capture)."""

    def capture(self, run: object) -> object:
        raise RuntimeError("operation not permitted when stream is capturing")

    def memory_bytes(self) -> int:
        return 0


def test_a_failed_capture_leaves_the_engine_eager(
    tiny_llama_dir: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    from blockserve import LLM, SamplingParams
    from blockserve.runner import start

    monkeypatch.setattr(start, "graph_capture", lambda device: FailingCapture())
    llm = LLM(
        str(tiny_llama_dir),
        dtype="float32",
        device=DEVICE,
        attention_backend="triton",
        num_gpu_blocks_override=64,
        max_num_seqs=8,
    )
    assert llm.engine.core.runner.decode_graphs is None
    assert llm.engine.core.info.runtime["cuda_graphs"] == 0
    assert "capturing the decode graphs failed; decode steps run eagerly" in caplog.text
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    (result,) = llm.generate([[5, 6, 7]], params, use_tqdm=False)
    assert len(result.outputs[0].token_ids) == 3
    llm.shutdown()
