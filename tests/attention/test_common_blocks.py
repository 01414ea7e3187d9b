"""Our kernel's packings of a shared prefix's common blocks, kept across steps
(attention/common_blocks.py): reused while steps read the same blocks, dropped when a step
writes into them or stops using them, or when a writer outside the forward says it wrote; and
attention over a kept packing equals attention that packs for each call."""

from __future__ import annotations

import threading

import pytest
import torch

from blockserve.attention.common_blocks import PackedCommonBlocks
from blockserve.attention.torch_backend import TorchAttentionBackend
from blockserve.kernels import CpuKernels
from tests.attention.cases import make_case, reference_attention
from tests.attention.test_torch_backend import TOLERANCE
from tests.kernels.test_cpu_kernel import DTYPES

BLOCKS = (3, 5)
IDS = torch.tensor(BLOCKS)


class Packer:
    """Stands for `pack_common`: each call's result is filled with its call number."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, k: torch.Tensor, v: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return torch.full((2, 1, 64 * len(ids)), float(self.calls))


def layer_cache() -> torch.Tensor:
    return torch.zeros(2, 8, 16, 1, 64)


def writing(block: int) -> torch.Tensor:
    """A step's slot mapping that writes one token into `block` (block size 16)."""
    return torch.tensor([block * 16 + 3])


def test_each_layers_packing_is_kept_while_steps_use_its_blocks() -> None:
    store, pack = PackedCommonBlocks(), Packer()
    layers = [layer_cache(), layer_cache()]
    for _ in range(3):
        store.begin_step(writing(6), 16, [BLOCKS])  # the step writes elsewhere
        got = [store.get(pack, layer, BLOCKS, IDS)[0, 0, 0].item() for layer in layers]
        assert got == [1.0, 2.0]
    assert (pack.calls, store.packs, store.reuses) == (2, 2, 4)


@pytest.mark.parametrize("event", ["a step writes into a block", "a step does not use them",
                                   "a writer outside the forward forgets them"])  # fmt: skip
def test_a_kept_packing_is_dropped(event: str) -> None:
    store, pack, layer = PackedCommonBlocks(), Packer(), layer_cache()
    store.begin_step(writing(6), 16, [BLOCKS])
    store.get(pack, layer, BLOCKS, IDS)
    if event.startswith("a step writes"):
        store.begin_step(writing(5), 16, [BLOCKS])
    elif event.startswith("a step does not"):
        store.begin_step(writing(6), 16, [(3,)])
        store.begin_step(writing(6), 16, [BLOCKS])
    else:
        forgetting = threading.Thread(target=store.forget)
        forgetting.start()
        forgetting.join()
        store.begin_step(writing(6), 16, [BLOCKS])
    assert store.get(pack, layer, BLOCKS, IDS)[0, 0, 0].item() == 2.0
    assert (store.packs, store.reuses) == (2, 0)


def test_another_cache_at_a_kept_ones_address_is_packed_anew() -> None:
    """A layer's cache freed and another allocated where it lay (here: another tensor over
    the same memory) is not served the first one's packing."""
    store, pack, layer = PackedCommonBlocks(), Packer(), layer_cache()
    store.begin_step(writing(6), 16, [BLOCKS])
    store.get(pack, layer, BLOCKS, IDS)
    other = layer.view(layer.shape)
    assert other.data_ptr() == layer.data_ptr()
    assert store.get(pack, other, BLOCKS, IDS)[0, 0, 0].item() == 2.0
    assert store.get(pack, other, BLOCKS, IDS)[0, 0, 0].item() == 2.0  # kept in its place
    assert (store.packs, store.reuses) == (2, 1)


def test_packings_past_the_limit_are_made_for_each_call() -> None:
    one = 2 * 1 * 64 * len(BLOCKS) * 4  # bytes of one layer's packing (float32)
    store, pack = PackedCommonBlocks(max_bytes=one), Packer()
    first, second = layer_cache(), layer_cache()
    for _ in range(2):
        store.begin_step(writing(6), 16, [BLOCKS])
        store.get(pack, first, BLOCKS, IDS)
        store.get(pack, second, BLOCKS, IDS)
    assert (store.packs, store.reuses) == (3, 1)  # the second layer's never fits


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_over_a_kept_packing_equals_packing_per_call(
    dtype: torch.dtype, kernels: CpuKernels
) -> None:
    """Bit for bit, with the AMX tiles and without where the host has them (they read the
    same layout); a packing of another size (five blocks: 128 keys padded) is refused."""
    ops = kernels.loader.ops(dtype)
    assert ops is not None
    generator = torch.Generator().manual_seed(4)
    kv = torch.randn(2, 20, 16, 2, 64, generator=generator).to(dtype)
    ids = torch.tensor([7, 2, 11])
    q = torch.randn(5, 2, 3, 64, generator=generator).to(dtype)
    packed = ops.pack_common(kv[0], kv[1], ids)
    assert packed.shape == (2, 2, 64 * 64)  # 48 keys, padded to a whole block of 64
    for tiles in (True, False):
        kernels.use_amx(tiles)
        try:
            fresh = ops.prefix_attention(q, kv[0], kv[1], ids, 0.125)
            kept = ops.prefix_attention(q, kv[0], kv[1], ids, 0.125, packed)
        finally:
            kernels.use_amx(True)
        assert torch.equal(fresh[0], kept[0]) and torch.equal(fresh[1], kept[1])
    other = ops.pack_common(kv[0], kv[1], torch.tensor([1, 2, 3, 4, 5]))
    with pytest.raises(RuntimeError, match="packed must be pack_common's result"):
        ops.prefix_attention(q, kv[0], kv[1], ids, 0.125, other)


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_steps_on_the_same_common_blocks_pack_them_once(
    dtype: torch.dtype, kernels: CpuKernels
) -> None:
    """Three decode steps over 4 common blocks: packed in the first, read as kept in the
    next two, each step's output what a backend packing every time gives, within tolerance of
    the reference; `forget_kv` makes the next step pack again."""
    assert kernels.loader.ops(dtype) is not None
    specs = [(64, 1), (64, 1), (70, 1), (99, 1), (65, 1)]
    case = make_case(specs, 6, 2, head_dim=64, dtype=dtype, shared_blocks=4, seed=3)
    backend, packing = (
        TorchAttentionBackend(kernels=kernels),
        TorchAttentionBackend(kernels=kernels),
    )
    packing.common_blocks.max_bytes = 0  # keeps nothing
    for _ in range(3):
        plan = backend.prepare(case.metadata)
        out = backend.forward(case.query, case.key, case.value, case.kv_cache, plan)
        again = packing.forward(
            case.query, case.key, case.value, case.kv_cache, packing.prepare(case.metadata)
        )
        assert torch.equal(out, again)
        assert (out.double() - reference_attention(case)).abs().max().item() < TOLERANCE[dtype]
    assert (backend.common_blocks.packs, backend.common_blocks.reuses) == (1, 2)
    assert packing.common_blocks.packs == 3
    backend.forget_kv()
    plan = backend.prepare(case.metadata)
    backend.forward(case.query, case.key, case.value, case.kv_cache, plan)
    assert (backend.common_blocks.packs, backend.common_blocks.reuses) == (2, 2)
