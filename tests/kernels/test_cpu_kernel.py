"""Our CPU attention kernels (csrc/cpu/attention.h), in both libraries (bf16 for
AVX512-BF16, on AMX tiles too where the CPU has them; f32 in its AVX2 build, and its AVX-512
build where the CPU has AVX-512F): built by g++ into the
cache dir, equal to a float64 reference within their dtype's rounding, refusing what they do
not handle, and used by the torch backend once loaded: the dense kernel for shared prefixes
and prefills, the paged one for decodes."""

from __future__ import annotations

import functools
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from blockserve.attention.prefill import attend_causal, causal_counts
from blockserve.attention.torch_backend import TorchAttentionBackend
from blockserve.kernels import CpuKernels, KernelLoader
from blockserve.kernels import build as cpu_build
from blockserve.kernels.sources import source_dir
from tests.attention.cases import make_case, reference_attention
from tests.attention.test_torch_backend import TOLERANCE

# Each library's tests run where the CPU has its instructions (and g++ is there to build it).
NEEDS = {
    torch.bfloat16: pytest.mark.skipif(
        not cpu_build.can_build(torch.bfloat16),
        reason="needs an x86 CPU with AVX512-BF16 and g++ (elsewhere torch's kernels serve)",
    ),
    torch.float32: pytest.mark.skipif(
        not cpu_build.can_build(torch.float32),
        reason="needs an x86 CPU with AVX2 and FMA, and g++ (elsewhere torch's kernels serve)",
    ),
}
DTYPES = [
    pytest.param(dtype, id=name, marks=NEEDS[dtype])
    for dtype, name in ((torch.bfloat16, "bf16"), (torch.float32, "f32"))
]
AMX = cpu_build.can_build(torch.bfloat16) and torch.cpu.get_capabilities().get("amx_bf16")
AVX512_F32 = cpu_build.can_build(torch.float32) and any(
    build.isa == "avx512" for build in cpu_build.runnable(torch.float32)
)
# The bf16 library's dense and prefix attention take two paths: AMX tiles where the CPU has
# them, AVX512-BF16 vectors alone otherwise. The f32 library has two builds: AVX-512F where
# the CPU has it, AVX2 (which such a CPU runs too). Each variant runs the module's tests.
VARIANTS = [
    pytest.param((torch.bfloat16, "vectors"), id="bf16", marks=NEEDS[torch.bfloat16]),
    pytest.param(
        (torch.bfloat16, "tiles"),
        id="bf16-amx",
        marks=pytest.mark.skipif(
            not AMX, reason="needs an x86 CPU with AMX-BF16 (elsewhere bf16 uses vectors alone)"
        ),
    ),
    pytest.param((torch.float32, "avx2"), id="f32", marks=NEEDS[torch.float32]),
    pytest.param(
        (torch.float32, "avx512"),
        id="f32-avx512",
        marks=pytest.mark.skipif(
            not AVX512_F32, reason="needs an x86 CPU with AVX-512F (elsewhere f32 runs on AVX2)"
        ),
    ),
]
NAMES = {torch.bfloat16: "bfloat16", torch.float32: "float32"}
# What the dense and prefix kernels' outputs may be off by, in units of the largest value:
# bf16 rounds the probabilities to bf16; float32 keeps them.
ROUNDING = {torch.bfloat16: 2**-8, torch.float32: 1e-6}

Kernel = Callable[..., tuple[torch.Tensor, torch.Tensor]]


@pytest.fixture(scope="module", params=VARIANTS)
def variant(request: pytest.FixtureRequest) -> tuple[torch.dtype, str]:
    return request.param


@pytest.fixture(scope="module")
def dtype(variant: tuple[torch.dtype, str]) -> torch.dtype:
    return variant[0]


OTHER_INSTALL_KERNELS = "bf16-000000000000-000000000000.so"


@pytest.fixture(scope="module")
def cache_dir(cpu_kernels_dir: Path) -> Path:
    return cpu_kernels_dir


def test_a_build_replaces_its_installs_older_library_only(cache_dir: Path) -> None:
    names = sorted(path.name for path in (cache_dir / "cpu_kernels").iterdir())
    # conftest.py's cpu_kernels_dir left an older build of each library and another install's
    # before building: each build replaced its own older one alone.
    built = [
        cpu_build.library_path(cache_dir, dtype, build.isa).name
        for dtype in cpu_build.LIBRARIES
        if cpu_build.can_build(dtype)
        for build in cpu_build.runnable(dtype)
    ]
    assert built and names == sorted([*built, OTHER_INSTALL_KERNELS])


@pytest.fixture(scope="module")
def ops(kernels: CpuKernels, cache_dir: Path, variant: tuple[torch.dtype, str]) -> Iterator[Any]:
    dtype, path = variant
    isa = path if dtype == torch.float32 else None
    loaded = kernels.loader.load(cache_dir, dtype, isa)
    assert loaded is not None
    if dtype == torch.bfloat16:
        assert kernels.use_amx(path == "tiles") == (path == "tiles")
    yield loaded
    kernels.use_amx(True)  # the defaults: tiles, the widest build
    kernels.loader.load(cache_dir, dtype, cpu_build.target_for(dtype).isa)


def test_tiles_are_used_exactly_where_the_cpu_has_amx(cache_dir: Path) -> None:
    kernels = CpuKernels()
    if not cpu_build.can_build(torch.bfloat16):
        assert not kernels.use_amx(True)  # no bf16 library to use them
        return
    assert kernels.loader.load(cache_dir, torch.bfloat16) is not None
    assert kernels.use_amx(True) == bool(AMX)
    assert not kernels.use_amx(False)
    assert kernels.use_amx(True) == bool(AMX)


@NEEDS[torch.bfloat16]
def test_widened_attention_gives_the_dot_products_bits(cache_dir: Path) -> None:
    """Dense, prefix, paged and one-call decode attention with their bf16 products on float32
    FMAs over the pairs widened give what `vdpbf16ps` gives, to the bit, on normal operands;
    on denormals, which `vdpbf16ps` reads as 0, they differ, as switching shows. The tiles,
    where the CPU has them, take precedence."""
    kernels = CpuKernels()
    ops = kernels.loader.load(cache_dir, torch.bfloat16)
    assert ops is not None
    generator = torch.Generator().manual_seed(11)
    q, k, v = (
        (torch.randn(2, 3, n, 64, generator=generator) * 1.5).bfloat16() for n in (37, 130, 130)
    )
    causal = (130 - 37 + 1 + torch.arange(37)).expand(2, 37)
    # 32 rows over 72 keys: rows 16-23 of the second 16-row task see none of the second key
    # block, rows 24-31 some (a widened task skips the 4-row tiles that see none).
    q2, k2, v2 = (torch.randn(1, 3, n, 64, generator=generator).bfloat16() for n in (32, 72, 72))
    causal2 = (72 - 32 + 1 + torch.arange(32)).expand(1, 32)
    k_cache, v_cache = shuffled_cache(generator, 12, 3, torch.bfloat16)
    decode_q = torch.randn(5, 9, 64, generator=generator).bfloat16()
    tables = torch.randint(0, 12, (5, 4), generator=generator)
    lengths = torch.tensor([1, 17, 64, 33, 50])
    common = torch.tensor([3, 7])

    def attend() -> list[torch.Tensor]:
        return [
            *ops.dense_attention(q, k, v, causal, 0.125),
            *ops.dense_attention(q2, k2, v2, causal2, 0.125),
            *ops.prefix_attention(decode_q.unflatten(1, (3, 3)), k_cache, v_cache, common, 0.125),
            *ops.paged_decode(decode_q, k_cache, v_cache, tables, lengths, 0.125),
            ops.decode_attention(decode_q, k_cache, v_cache, tables, lengths, 0.125, common),
        ]

    # Where the two differ, the switch shows: a query of one bf16 denormal against keys near
    # bf16's largest value scores 0 on vdpbf16ps (it reads denormals as 0), ±0.3 widened.
    tiny = torch.zeros(64).index_fill(0, torch.tensor([0]), 1e-39).bfloat16()
    keys = torch.zeros(4, 64)
    keys[:, 0] = torch.tensor([3e38, -3e38, 3e38, -3e38])
    keys, values = keys.bfloat16(), torch.eye(4, 64).bfloat16()

    def attend_denormal() -> list[torch.Tensor]:
        dense, _ = ops.dense_attention(tiny.view(1, 1, 1, 64), keys[None, None],
                                       values[None, None], None, 1.0)  # fmt: skip
        cache = [torch.zeros(1, 16, 1, 64).bfloat16() for _ in range(2)]
        cache[0][0, :4, 0], cache[1][0, :4, 0] = keys, values
        table, length = torch.zeros(1, 1, dtype=torch.int32), torch.tensor([4])
        paged, _ = ops.paged_decode(tiny.view(1, 1, 64), *cache, table, length, 1.0)
        return [dense[0, 0, 0, :4], paged[0, 0, :4]]

    try:
        if AMX:
            assert kernels.use_amx(True) and not kernels.use_wide_attention(True)
        kernels.use_amx(False)
        assert not kernels.use_wide_attention(False)
        narrow, narrow_denormal = attend(), attend_denormal()
        assert kernels.use_wide_attention(True)
        widened, widened_denormal = attend(), attend_denormal()
    finally:
        kernels.use_wide_attention(False)
        kernels.use_amx(True)
    assert all(torch.equal(a, b) for a, b in zip(narrow, widened, strict=True))
    assert all(torch.isfinite(out).all() for out in widened[1::2])  # every row saw a key
    score = (tiny[0].float() * keys[0, 0].float()).item()  # ~0.3: e^±score, normalized
    weights = torch.tensor([score, -score, score, -score]).softmax(0)  # 0.324, 0.176, ...
    for narrow_out, widened_out in zip(narrow_denormal, widened_denormal, strict=True):
        torch.testing.assert_close(narrow_out, torch.full((4,), 0.25), rtol=1e-6, atol=0)
        torch.testing.assert_close(widened_out, weights, rtol=ROUNDING[torch.bfloat16], atol=0)


AVX2_HOST = {"avx": True, "avx2": True, "fma3": True}
AVX512_HOST = {**AVX2_HOST, "avx512_f": True, "avx512_bw": True, "avx512_vl": True}


@pytest.mark.parametrize(
    ("flags", "f32_builds", "bf16_builds"),
    [
        (AVX2_HOST, ["avx2"], []),
        (AVX512_HOST, ["avx512", "avx2"], []),
        (
            {**AVX512_HOST, "avx512_bf16": True, "avx512_vnni": True, "f16c": True},
            ["avx512", "avx2"],
            ["avx512-bf16"],
        ),
        ({**AVX512_HOST, "avx512_bf16": True}, ["avx512", "avx2"], []),  # no VNNI, F16C
        ({"avx": True, "avx512_f": True}, [], []),  # no AVX2 and FMA: neither build
        ({}, [], []),  # not an x86 CPU
    ],
)
def test_a_host_runs_the_widest_build_it_has_the_instructions_for(
    flags: dict[str, bool],
    f32_builds: list[str],
    bf16_builds: list[str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: flags)
    assert [build.isa for build in cpu_build.runnable(torch.float32)] == f32_builds
    assert [build.isa for build in cpu_build.runnable(torch.bfloat16)] == bf16_builds
    assert cpu_build.runnable(torch.float16) == ()
    if not f32_builds:
        with pytest.raises(ValueError, match=r"no build of the torch\.float32 CPU kernels"):
            cpu_build.target_for(torch.float32)
        return
    assert cpu_build.target_for(torch.float32).isa == f32_builds[0]
    names = {cpu_build.library_path(tmp_path, torch.float32, isa).name for isa in f32_builds}
    assert {name.split("-")[0] for name in names} == {
        {"avx512": "f32_avx512", "avx2": "f32"}[isa] for isa in f32_builds
    }
    if "avx512" not in f32_builds:
        with pytest.raises(ValueError, match=r"no avx512 build of the torch\.float32 CPU kernels"):
            cpu_build.target_for(torch.float32, "avx512")


@pytest.mark.skipif(not AVX512_F32, reason="needs an x86 CPU with AVX-512F: one f32 build only")
def test_both_float32_builds_pack_common_blocks_alike_and_agree(cache_dir: Path) -> None:
    """A packing kept across steps serves either build (the layout is the same); the two
    compute the same attention up to float32 rounding (their sums run in other orders)."""
    kernels = CpuKernels()
    narrow = kernels.loader.load(cache_dir, torch.float32, "avx2")
    wide = kernels.loader.load(cache_dir, torch.float32, "avx512")
    assert narrow is not None and wide is not None and narrow is not wide
    assert kernels.loader.isa(torch.float32) == "avx512"
    generator = torch.Generator().manual_seed(12)
    kv = torch.randn(2, 90, 16, 3, 64, generator=generator)
    ids = torch.tensor([5, 80, 17, 3, 44, 61, 29])  # 112 keys: a partial group of 16 padded
    q = torch.randn(7, 3, 3, 64, generator=generator)
    packed = narrow.pack_common(kv[0], kv[1], ids)
    assert torch.equal(packed, wide.pack_common(kv[0], kv[1], ids))
    results = [ops.prefix_attention(q, kv[0], kv[1], ids, 0.125, packed) for ops in (narrow, wide)]
    torch.testing.assert_close(results[0][0], results[1][0], rtol=0, atol=2e-6)
    torch.testing.assert_close(results[0][1], results[1][1], rtol=0, atol=2e-6)
    tables = torch.tensor([[9, 70, 31], [2, 88, 0]])
    lengths = torch.tensor([37, 17])
    queries = torch.randn(2, 9, 64, generator=generator)
    decodes = [
        ops.paged_decode(queries, kv[0], kv[1], tables, lengths, 0.125) for ops in (narrow, wide)
    ]
    torch.testing.assert_close(decodes[0][0], decodes[1][0], rtol=0, atol=2e-6)
    torch.testing.assert_close(decodes[0][1], decodes[1][1], rtol=0, atol=2e-6)


@pytest.fixture(scope="module")
def kernel(kernels: CpuKernels, ops: Any, dtype: torch.dtype) -> Kernel:
    op = kernels.dense_attention(torch.zeros(1, 64, dtype=dtype))
    assert op is ops.dense_attention
    return op


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths, scale: float):
    """float64 attention in which row r of batch b sees keys 0 .. lengths[b, r] - 1."""
    scores = q.double() @ k.double().transpose(-1, -2) * scale
    if lengths is not None:
        seen = torch.arange(k.shape[2])[None, None, None, :] < lengths[:, None, :, None]
        scores = scores.masked_fill(~seen, float("-inf"))
    return torch.softmax(scores, -1).nan_to_num(0.0) @ v.double(), torch.logsumexp(scores, -1)


@pytest.mark.parametrize(
    ("batch", "heads", "rows", "keys", "seen"),
    [
        (1, 1, 1, 1, "all"),
        (1, 3, 5, 37, "all"),
        (2, 2, 17, 64, "all"),
        (1, 1, 33, 1000, "all"),
        (1, 3, 192, 1024, "all"),  # a shared-prefix decode step's common blocks
        (64, 3, 3, 64, "some"),  # its decodes' own blocks, padded
        (5, 3, 96, 130, "causal"),  # prefill chunks on their own earlier tokens
        (2, 2, 7, 100, "some or none"),  # a padding row sees nothing
    ],
)
def test_equals_float64_attention(
    kernel: Kernel, dtype: torch.dtype, batch: int, heads: int, rows: int, keys: int, seen: str
) -> None:
    """Rows and keys off the kernels' tiles (4, 6 or 16 rows, 64 keys) included: the padding is
    unseen. The output's error is the probabilities' rounding (ROUNDING of the largest value).
    A row that sees no key gets zeros and a log-sum-exp of -inf."""
    generator = torch.Generator().manual_seed(rows * 1000 + keys)
    q, k, v = (
        (torch.randn(batch, heads, n, 64, generator=generator) * 1.5).to(dtype)
        for n in (rows, keys, keys)
    )
    lengths = {
        "all": None,
        "some": torch.randint(1, keys + 1, (batch, 1), generator=generator).expand(batch, rows),
        "causal": (keys - rows + 1 + torch.arange(rows)).expand(batch, rows),
        "some or none": torch.randint(0, keys + 1, (batch, rows), generator=generator),
    }[seen]
    if seen == "some or none":
        lengths[0, 0] = 0
    out, lse = kernel(q, k, v, lengths, 0.125)
    expected_out, expected_lse = reference(q, k, v, lengths, 0.125)
    assert out.dtype == lse.dtype == torch.float32
    assert out.shape == (batch, heads, rows, 64) and lse.shape == (batch, heads, rows)
    bound = ROUNDING[dtype] * v.abs().max().item()
    assert (out.double() - expected_out).abs().max().item() < bound
    finite = torch.isfinite(expected_lse)
    assert (lse.double()[finite] - expected_lse[finite]).abs().max().item() < 1e-5
    assert torch.equal(torch.isfinite(lse), finite)
    assert (out[~finite] == 0).all()


def test_dense_attention_reads_views_in_place(kernel: Kernel, dtype: torch.dtype) -> None:
    """q, k and v as views of other layouts ([tokens, heads, 64] transposed, as the prefill
    path passes them; a wider tensor's slice) give what their contiguous copies give, to the
    bit; a last dimension of stride 2 is copied first and gives the same."""
    generator = torch.Generator().manual_seed(5)
    q = (torch.randn(1, 2, 37, 128, generator=generator) * 1.5).to(dtype)[..., ::2]
    k, v = (
        torch.randn(90, 2, 64, generator=generator).to(dtype).transpose(0, 1)[None]
        for _ in range(2)
    )
    lengths = torch.randint(0, 91, (1, 37), generator=generator)
    views = kernel(q, k, v, lengths, 0.125)
    copies = kernel(q.contiguous(), k.contiguous(), v.contiguous(), lengths, 0.125)
    assert all(torch.equal(a, b) for a, b in zip(views, copies, strict=True))


def test_a_prefills_attention_goes_into_its_rows_of_the_output(
    kernel: Kernel, dtype: torch.dtype
) -> None:
    """attend_causal writes each query's heads (the kernel's rows by KV head, then by query)
    into its rows of the layer's output in the query's dtype and leaves the other rows;
    the same bits as rounding the reordered rows, and as it returns given no output."""
    generator = torch.Generator().manual_seed(23)
    query = (torch.randn(40, 6, 64, generator=generator) * 1.5).to(dtype)[10:30]
    key, value = (torch.randn(50, 2, 64, generator=generator).to(dtype) for _ in "kv")
    output = torch.full((40, 6, 64), 7.0, dtype=dtype)
    written = attend_causal(kernel, query, key, value, into=output[10:30])
    assert written.data_ptr() == output[10:30].data_ptr()
    rows, _ = kernel(
        query.view(20, 2, 3, 64).permute(1, 2, 0, 3).reshape(1, 2, 60, 64),
        key.transpose(0, 1)[None],
        value.transpose(0, 1)[None],
        causal_counts(50, 20, 3, query.device),
        0.125,
    )
    by_query = rows.view(2, 3, 20, 64).permute(2, 0, 1, 3).reshape(20, 6, 64).to(dtype)
    assert torch.equal(output[10:30], by_query)
    assert bool((output[:10] == 7.0).all() and (output[30:] == 7.0).all())
    assert torch.equal(attend_causal(kernel, query, key, value), by_query)


def test_dense_attention_continues_from_a_prior(kernel: Kernel, dtype: torch.dtype) -> None:
    """Rows through some keys, then through others continuing from that result (the prior):
    attention over both, as if in one softmax, each row seeing a prefix of the second set
    (none, for the first row). A prior row that saw no key (log-sum-exp -inf) starts afresh."""
    batch, heads, rows = 2, 3, 21
    generator = torch.Generator().manual_seed(11)
    q, first_k, first_v, k, v = (
        (torch.randn(batch, heads, n, 64, generator=generator) * 1.5).to(dtype)
        for n in (rows, 70, 70, 40, 40)
    )
    lengths = torch.randint(0, 41, (batch, rows), generator=generator)
    lengths[0, 0] = 0
    prior = kernel(q, first_k, first_v, None, 0.125)
    wide = torch.zeros(batch, heads, rows, 128)[..., 32:96]  # the strides of a view
    out, lse = kernel(q, k, v, lengths, 0.125, wide.copy_(prior[0]), prior[1])
    both_k, both_v = torch.cat([first_k, k], dim=2), torch.cat([first_v, v], dim=2)
    expected_out, expected_lse = reference(q, both_k, both_v, lengths + 70, 0.125)
    bound = ROUNDING[dtype] * both_v.abs().max().item()
    assert (out.double() - expected_out).abs().max().item() < bound
    assert (lse.double() - expected_lse).abs().max().item() < 1e-5

    empty = kernel(
        q, k, v, lengths, 0.125,
        torch.full_like(prior[0], 7.0), torch.full_like(prior[1], float("-inf")),
    )  # fmt: skip
    alone = kernel(q, k, v, lengths, 0.125)
    assert all(torch.equal(a, b) for a, b in zip(empty, alone, strict=True))


def test_the_exp_polynomial_is_within_float32_rounding() -> None:
    """The coefficients both libraries' exponentials use (exp2.h), evaluated as the
    kernels do (Horner's order, one rounding to float32 a step), give 2^f within 2.5e-7 of
    its value over [-0.5, 0.5]: about two float32 roundings, as the Taylor series of a degree
    more they replaced."""
    header = (source_dir("cpu") / "exp2.h").read_text()
    body = re.search(r"kExp2Poly\[kExp2Terms\] = \{([^}]*)\}", header)
    assert body is not None
    coefficients = [
        float(c.rstrip("f")) for c in body.group(1).replace("\n", "").split(",") if c.strip()
    ]
    assert len(coefficients) == 6
    f = torch.linspace(-0.5, 0.5, 100_001, dtype=torch.float32)
    p = torch.full_like(f, coefficients[0])
    for c in coefficients[1:]:
        p = (p.double() * f.double() + torch.tensor(c, dtype=torch.float32).double()).float()
    exact = torch.exp2(f.double())
    assert (p.double() / exact - 1).abs().max().item() < 2.5e-7


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda q, k, v: (q.half(), k, v), "must be {dtype}"),
        (lambda q, k, v: (q[..., :32], k[..., :32], v[..., :32]), "head dimension must be 64"),
        (lambda q, k, v: (q, k[:, :, :0], v[:, :, :0]), "at least one key"),
        (lambda q, k, v: (q, k, v[:, :, :3]), "k and v must match"),
        (lambda q, k, v: (q[0], k[0], v[0]), "must be \\[batch, heads, n, 64\\]"),
    ],
)
def test_refuses_what_it_does_not_handle(
    kernel: Kernel, dtype: torch.dtype, change, message: str
) -> None:
    q, k, v = (torch.zeros(1, 2, 8, 64, dtype=dtype) for _ in range(3))
    with pytest.raises(RuntimeError, match=message.format(dtype=NAMES[dtype])):
        kernel(*change(q, k, v), None, 0.125)
    with pytest.raises(RuntimeError, match="lengths must be"):
        kernel(q, k, v, torch.ones(1, 3, dtype=torch.long), 0.125)
    out, lse = torch.zeros(1, 2, 8, 64), torch.zeros(1, 2, 8)
    for prior, refusal in [
        ((out, None), "come together"),
        ((out[:, :, :7], lse[:, :, :7]), "prior_out must be \\[batch, heads, rows, 64\\]"),
        ((out.double(), lse), "must be float32"),
        ((out[..., ::2], lse), "prior_out must be"),
    ]:
        with pytest.raises(RuntimeError, match=refusal):
            kernel(q, k, v, None, 0.125, *prior)


@pytest.mark.parametrize(
    ("specs", "shared_blocks", "expected"),
    [
        # decodes on a shared prefix: its blocks read in place, then the paged decode, one call
        ([(64, 1), (64, 1), (70, 1), (99, 1), (65, 1)], 4, ["decode"]),
        # prefill chunks on one: the common blocks in place, each chunk's own keys packed
        ([(48, 32), (50, 5), (70, 17), (0, 20), (60, 1)], 3, ["decode", "dense", "prefix"]),
        ([(0, 20), (37, 9), (0, 70)], 0, ["dense"]),  # prefills one by one
    ],
)
def test_the_backend_paths_use_it(
    kernels: CpuKernels,
    kernel: Kernel,
    dtype: torch.dtype,
    monkeypatch: pytest.MonkeyPatch,
    specs,
    shared_blocks: int,
    expected,
) -> None:
    """Steps call the kernels for shared prefixes and prefills and still equal dense
    attention."""
    calls: set[str] = set()
    for name in ("dense", "prefix", "decode"):
        find = getattr(kernels, f"{name}_attention")
        monkeypatch.setattr(
            kernels,
            f"{name}_attention",
            lambda q, find=find, name=name: calls.add(name) or find(q),
        )
    case = make_case(specs, 6, 2, head_dim=64, dtype=dtype, shared_blocks=shared_blocks)
    backend = TorchAttentionBackend(kernels=kernels)
    out = backend.forward(
        case.query, case.key, case.value, case.kv_cache, backend.prepare(case.metadata)
    )
    assert sorted(calls) == expected
    error = (out.double() - reference_attention(case)).abs().max().item()
    assert error < TOLERANCE[dtype]


@pytest.fixture(scope="module")
def prefix(kernels: CpuKernels, ops: Any, dtype: torch.dtype) -> Kernel:
    op = kernels.prefix_attention(torch.zeros(1, 64, dtype=dtype))
    assert op is ops.prefix_attention
    return op


def shuffled_cache(
    generator: torch.Generator, blocks: int, kv_heads: int, dtype: torch.dtype, block_size: int = 16
):
    return tuple(
        torch.randn(blocks, block_size, kv_heads, 64, generator=generator).to(dtype)
        for _ in range(2)
    )


@pytest.mark.parametrize(
    ("outer", "kv_heads", "inner", "num_blocks"),
    [(1, 1, 1, 1), (64, 3, 3, 64), (2, 2, 37, 5)],  # (64, 3, 3): a decode step's query
)
def test_prefix_attention_reads_whole_blocks_in_place(
    kernel: Kernel,
    prefix: Kernel,
    dtype: torch.dtype,
    outer: int,
    kv_heads: int,
    inner: int,
    num_blocks: int,
) -> None:
    """Every query of KV head h (q[:, h], read where it lies: here a strided view) against
    every key of the listed blocks, in their listed order: what the dense kernel gives on them
    gathered, to the bit."""
    generator = torch.Generator().manual_seed(inner)
    k_cache, v_cache = shuffled_cache(generator, 2 * num_blocks + 1, kv_heads, dtype)
    ids = torch.randperm(2 * num_blocks + 1, generator=generator)[:num_blocks]
    wide = torch.randn(outer, kv_heads, inner, 128, generator=generator).to(dtype)
    q = wide[..., 32:96]  # strides of a view into a wider tensor
    out, lse = prefix(q, k_cache, v_cache, ids, 0.125)
    rows = q.permute(1, 0, 2, 3).reshape(1, kv_heads, outer * inner, 64)
    k, v = (c[ids].reshape(-1, kv_heads, 64).transpose(0, 1)[None] for c in (k_cache, v_cache))
    gathered_out, gathered_lse = kernel(rows, k, v, None, 0.125)
    assert out.shape == (kv_heads, outer * inner, 64) and lse.shape == (kv_heads, outer * inner)
    assert torch.equal(out, gathered_out[0]) and torch.equal(lse, gathered_lse[0])
    expected_out, _ = reference(rows, k, v, None, 0.125)
    bound = ROUNDING[dtype] * v.abs().max().item()
    assert (out.double() - expected_out[0]).abs().max().item() < bound


def test_packed_keys_and_values_past_the_last_block_are_zero(ops: Any, dtype: torch.dtype) -> None:
    """3 blocks of 16 keys pack to 64 per head: the 16 past them are zero in K and in V (never
    what the allocator left there, which the products would still read)."""
    generator = torch.Generator().manual_seed(3)
    k_cache, v_cache = shuffled_cache(generator, 5, 2, dtype)
    ids = torch.tensor([4, 0, 2])
    for _ in range(3):  # freed and reused memory holding NaN, as a pad would
        torch.full((2, 2, 64 * 64), float("nan"), dtype=dtype)
        packed = ops.pack_common(k_cache, v_cache, ids)
        assert packed.shape == (2, 2, 64 * 64)
        assert torch.count_nonzero(packed[..., 48 * 64 :]).item() == 0
        assert torch.count_nonzero(packed[..., : 48 * 64]).item() == 2 * 2 * 48 * 64


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda a: {**a, "q": a["q"].half()}, "must be {dtype}"),
        (lambda a: {**a, "q": a["q"].new_zeros(1, 3, 4, 64)}, "per KV head"),
        (lambda a: {**a, "q": a["q"][0]}, "\\[n, kv_heads, m, 64\\]"),
        (lambda a: {**a, "q": a["q"].new_zeros(1, 2, 64, 4).transpose(2, 3)}, "unit stride"),
        (lambda a: {**a, "ids": torch.tensor([1, 4])}, "outside the cache"),
        (lambda a: {**a, "ids": torch.tensor([], dtype=torch.long)}, "n >= 1"),
        (lambda a: {**a, "k": a["k"].transpose(0, 1)}, "contiguous and of one shape"),
    ],
)
def test_prefix_attention_refuses_what_it_does_not_handle(
    prefix: Kernel, dtype: torch.dtype, change, message
):
    args = {
        "q": torch.zeros(1, 2, 4, 64, dtype=dtype),
        "k": torch.zeros(4, 16, 2, 64, dtype=dtype),
        "v": torch.zeros(4, 16, 2, 64, dtype=dtype),
        "ids": torch.tensor([1, 3]),
    }
    args = change(args)
    with pytest.raises(RuntimeError, match=message.format(dtype=NAMES[dtype])):
        prefix(args["q"], args["k"], args["v"], args["ids"], 0.125)


@pytest.fixture(scope="module")
def paged(ops: Any) -> Kernel:
    return ops.paged_decode


def paged_reference(q, k_cache, v_cache, tables, lengths, scale: float):
    """float64 decode attention, each sequence over its first `lengths[s]` tokens of the
    blocks `tables[s]` lists."""
    seqs, heads, dim = q.shape
    kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    outs, lses = [], []
    for s in range(seqs):
        blocks = tables[s, : -(-int(lengths[s]) // block_size)]
        k, v = (
            c[blocks].reshape(-1, kv_heads, dim)[: lengths[s]].double() for c in (k_cache, v_cache)
        )
        scores = torch.einsum("hgd,nhd->hgn", q[s].double().view(kv_heads, -1, dim), k) * scale
        outs.append(torch.einsum("hgn,nhd->hgd", scores.softmax(-1), v).reshape(heads, dim))
        lses.append(torch.logsumexp(scores, -1).reshape(heads))
    return torch.stack(outs), torch.stack(lses)


@pytest.mark.parametrize(
    ("seqs", "kv_heads", "group", "block_size", "max_blocks"),
    [
        (1, 1, 1, 16, 1),
        (4, 3, 3, 16, 21),  # SmolLM2's heads; chats of ~330 tokens
        (5, 2, 4, 4, 40),  # 4-token blocks: a chunk of 16 keys never crosses a block
        (3, 1, 8, 16, 9),  # the largest group it takes
        (64, 3, 3, 16, 70),
        (2, 3, 3, 16, 64),  # 6 tasks of up to 1,024 keys: split into ranges, merged after
    ],
)
def test_paged_decode_equals_float64_attention(
    paged: Kernel,
    dtype: torch.dtype,
    seqs: int,
    kv_heads: int,
    group: int,
    block_size: int,
    max_blocks: int,
) -> None:
    """Keys read in place through shuffled block tables, lengths from 1 to a full table (a
    last block cut anywhere): float32 sums of products and float32 probabilities, so the error
    is float32 rounding."""
    generator = torch.Generator().manual_seed(seqs * 100 + group)
    num_blocks = seqs * max_blocks + 1
    k_cache, v_cache = (
        torch.randn(num_blocks, block_size, kv_heads, 64, generator=generator).to(dtype)
        for _ in range(2)
    )
    q = (torch.randn(seqs, kv_heads * group, 64, generator=generator) * 1.5).to(dtype)
    tables = torch.randperm(num_blocks, generator=generator)[: seqs * max_blocks].view(seqs, -1)
    lengths = torch.randint(1, max_blocks * block_size + 1, (seqs,), generator=generator)
    lengths[0] = 1
    out, lse = paged(q, k_cache, v_cache, tables.int(), lengths, 0.125)
    expected_out, expected_lse = paged_reference(q, k_cache, v_cache, tables, lengths, 0.125)
    assert out.dtype == lse.dtype == torch.float32
    assert out.shape == q.shape and lse.shape == q.shape[:2]
    assert (out.double() - expected_out).abs().max().item() < 1e-5
    assert (lse.double() - expected_lse).abs().max().item() < 1e-5


def test_paged_decode_continues_from_a_prior(
    prefix: Kernel, paged: Kernel, dtype: torch.dtype
) -> None:
    """Common blocks through `prefix_attention`, then each sequence's own blocks through the
    paged decode continuing from that result: attention over both, as if in one softmax. A
    prior row that saw no key (log-sum-exp -inf) starts afresh."""
    seqs, kv_heads, group = 6, 3, 3
    generator = torch.Generator().manual_seed(7)
    k_cache, v_cache = shuffled_cache(generator, 40, kv_heads, dtype)
    common = torch.tensor([5, 2, 30])
    tables = torch.randperm(40, generator=generator)[: seqs * 4].view(seqs, 4)
    lengths = torch.tensor([1, 16, 17, 40, 64, 33])
    q = (torch.randn(seqs, kv_heads * group, 64, generator=generator) * 1.5).to(dtype)
    prior_out, prior_lse = prefix(
        q.view(seqs, kv_heads, group, 64), k_cache, v_cache, common, 0.125
    )
    prior_out = prior_out.view(kv_heads, seqs, group, 64).transpose(0, 1)
    prior_lse = prior_lse.view(kv_heads, seqs, group).transpose(0, 1)
    out, lse = paged(q, k_cache, v_cache, tables, lengths, 0.125, prior_out, prior_lse)
    whole = torch.cat([common.expand(seqs, -1), tables], dim=1)
    expected_out, expected_lse = paged_reference(q, k_cache, v_cache, whole, lengths + 48, 0.125)
    # The common part's probabilities are rounded as the dense kernel's are, the rest not.
    bound = ROUNDING[dtype] * v_cache.abs().max().item()
    assert (out.double() - expected_out).abs().max().item() < bound
    assert (lse.double() - expected_lse).abs().max().item() < 1e-5

    empty = paged(
        q, k_cache, v_cache, tables, lengths, 0.125,
        torch.full_like(prior_out, 7.0), torch.full_like(prior_lse, float("-inf")),
    )  # fmt: skip
    alone = paged(q, k_cache, v_cache, tables, lengths, 0.125)
    assert all(torch.equal(a, b) for a, b in zip(empty, alone, strict=True))


@pytest.mark.parametrize("own", [1, 300, 700])
def test_one_sequence_split_into_ranges_continues_from_a_prior(
    prefix: Kernel, paged: Kernel, dtype: torch.dtype, own: int
) -> None:
    """One sequence's 3 KV heads are too few tasks: its keys are split into ranges (700 keys:
    two of up to 352), the first continuing from the prior, then merged; a single key or
    fewer than 512 keep one range. Either way attention over the common blocks and its own."""
    kv_heads, group, blocks = 3, 3, 50
    generator = torch.Generator().manual_seed(own)
    k_cache, v_cache = shuffled_cache(generator, blocks + 3, kv_heads, dtype)
    common = torch.tensor([blocks, blocks + 1, blocks + 2])
    tables = torch.randperm(blocks, generator=generator).view(1, blocks)
    lengths = torch.tensor([own])
    q = (torch.randn(1, kv_heads * group, 64, generator=generator) * 1.5).to(dtype)
    prior_out, prior_lse = prefix(q.view(1, kv_heads, group, 64), k_cache, v_cache, common, 0.125)
    prior_out = prior_out.view(kv_heads, 1, group, 64).transpose(0, 1)
    prior_lse = prior_lse.view(kv_heads, 1, group).transpose(0, 1)
    out, lse = paged(q, k_cache, v_cache, tables, lengths, 0.125, prior_out, prior_lse)
    whole = torch.cat([common.expand(1, -1), tables], dim=1)
    expected_out, expected_lse = paged_reference(q, k_cache, v_cache, whole, lengths + 48, 0.125)
    bound = ROUNDING[dtype] * v_cache.abs().max().item()  # the common part's, as above
    assert (out.double() - expected_out).abs().max().item() < bound
    assert (lse.double() - expected_lse).abs().max().item() < 1e-5
    alone_out, alone_lse = paged(q, k_cache, v_cache, tables, lengths, 0.125)
    expected_out, expected_lse = paged_reference(q, k_cache, v_cache, tables, lengths, 0.125)
    assert (alone_out.double() - expected_out).abs().max().item() < 1e-5
    assert (alone_lse.double() - expected_lse).abs().max().item() < 1e-5


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda a: {**a, "q": a["q"].half()}, "must be {dtype}"),
        (lambda a: {**a, "q": a["q"][..., :32]}, "head dimension must be 64"),
        (lambda a: {**a, "prior": (torch.zeros(2, 2, 3, 64), None)}, "come together"),
        (lambda a: {**a, "prior": (torch.zeros(2, 2, 3, 64), torch.zeros(2, 6))}, "prior_out must"),
        (
            lambda a: {**a, "prior": (torch.zeros(2, 2, 3, 64).double(), torch.zeros(2, 2, 3))},
            "float32",
        ),
        (lambda a: {**a, "q": a["q"].new_zeros(2, 18, 64)}, "1 to 8 per KV head"),
        (lambda a: {**a, "tables": a["tables"] + 10}, "outside the cache"),
        (lambda a: {**a, "lengths": torch.tensor([5, 33])}, "exceeds its block table"),
        (lambda a: {**a, "lengths": torch.tensor([5])}, "lengths \\[seqs\\]"),
        (lambda a: {**a, "k": a["k"].transpose(0, 1)}, "contiguous and of one shape"),
    ],
)
def test_paged_decode_refuses_what_it_does_not_handle(
    paged: Kernel, dtype: torch.dtype, change, message
) -> None:
    args = {
        "q": torch.zeros(2, 6, 64, dtype=dtype),
        "k": torch.zeros(4, 16, 2, 64, dtype=dtype),
        "v": torch.zeros(4, 16, 2, 64, dtype=dtype),
        "tables": torch.tensor([[1, 2], [3, 0]]),
        "lengths": torch.tensor([20, 3]),
        "prior": (None, None),
    }
    args = change(args)
    with pytest.raises(RuntimeError, match=message.format(dtype=NAMES[dtype])):
        paged(
            args["q"], args["k"], args["v"], args["tables"], args["lengths"], 0.125, *args["prior"]
        )


@pytest.mark.parametrize(
    ("specs", "shared_blocks"),
    [
        ([(64, 1), (80, 1), (70, 1), (99, 1), (65, 1)], 4),  # own blocks after a shared prefix
        ([(30, 1), (1, 1), (47, 1), (0, 20)], 0),  # nothing shared, a prefill in the step
    ],
)
def test_decodes_read_their_blocks_in_place(
    kernels: CpuKernels,
    ops: Any,
    prefix: Kernel,
    paged: Kernel,
    dtype: torch.dtype,
    monkeypatch: pytest.MonkeyPatch,
    specs,
    shared_blocks: int,
) -> None:
    """Decodes go through `decode_attention` (the common blocks once, then the paged kernel:
    no gather) and equal dense attention, as the torch path does with it switched off, and
    equal to the bit the two kernels called one after the other, in the query's dtype."""
    calls = []

    def counted(q: torch.Tensor) -> Kernel:
        calls.append(q.dtype)
        return ops.decode_attention

    case = make_case(specs, 9, 3, head_dim=64, dtype=dtype, shared_blocks=shared_blocks)
    backend = TorchAttentionBackend(kernels=kernels)
    plan = backend.prepare(case.metadata)
    expected = reference_attention(case)
    monkeypatch.setattr(kernels, "decode_attention", lambda q: None)
    without = backend.forward(case.query, case.key, case.value, case.kv_cache, plan)
    monkeypatch.setattr(kernels, "decode_attention", counted)
    with_kernel = backend.forward(case.query, case.key, case.value, case.kv_cache, plan)
    assert calls == [dtype]
    for out in (without, with_kernel):
        assert (out.double() - expected).abs().max().item() < TOLERANCE[dtype]

    decode = plan.decode
    assert decode is not None
    rows, (k_cache, v_cache) = decode.token_indices, case.kv_cache
    q = case.query[rows]
    prior = ()
    if decode.common_block_ids is not None:
        out, lse = prefix(q.unflatten(1, (3, 3)), k_cache, v_cache, decode.common_block_ids, 0.125)
        prior = (out.view(3, len(rows), 3, 64).transpose(0, 1), lse.view(3, -1, 3).transpose(0, 1))
    apart, _ = paged(q, k_cache, v_cache, decode.own_tables, decode.own_lengths, 0.125, *prior)
    fused = ops.decode_attention(
        q, k_cache, v_cache, decode.own_tables, decode.own_lengths, 0.125,
        decode.common_block_ids,
    )  # fmt: skip
    assert fused.dtype == dtype and torch.equal(fused, apart.to(dtype))
    assert torch.equal(with_kernel[rows], fused)


def test_switched_off_torch_serves(
    kernels: CpuKernels, kernel: Kernel, prefix: Kernel, ops: Any, dtype: torch.dtype
) -> None:
    """Each switch takes out its kernels."""
    q, hidden = torch.zeros(2, 64, dtype=dtype), torch.zeros(2, 576, dtype=dtype)

    def served() -> tuple[bool, ...]:
        return (
            kernels.dense_attention(q) is kernel,
            kernels.prefix_attention(q) is prefix,
            kernels.decode_attention(q) is ops.decode_attention,
            kernels.layer_ops(hidden, head_dim=64) is not None,
        )

    kernels.set_enabled(False)
    try:
        assert served() == (False, False, False, False)
        kernels.set_enabled(True, paged=False)
        assert served() == (True, True, False, True)
        kernels.set_enabled(True, layer=False)
        assert served() == (True, True, True, False)
        kernels.set_enabled(False, paged=True)  # the decodes' path runs prefix_attention
        assert served() == (False, False, False, False)
    finally:
        kernels.set_enabled(True)
    assert served() == (True, True, True, True)
    # Not for another dtype, other head widths, or a hidden size off the 16-wide vectors.
    assert kernels.dense_attention(q.half()) is None
    assert kernels.decode_attention(q[:, :32]) is None
    assert kernels.layer_ops(hidden.half(), head_dim=64) is None
    assert kernels.layer_ops(hidden, head_dim=128) is None
    assert kernels.layer_ops(hidden[:, :40], head_dim=64) is None


@pytest.mark.slow
def test_a_later_load_uses_the_built_library(
    kernel: Kernel, cache_dir: Path, dtype: torch.dtype, tmp_path: Path
) -> None:
    """Named by what it was built from, the library is found again by a new process, not
    rebuilt; in this process, whose torch has its operators, a new loader takes them from
    torch and reads no file (an empty cache dir)."""
    script = (
        "import sys, torch\n"
        "from pathlib import Path\n"
        "from blockserve.kernels import loader\n"
        "def no_build(*args): raise AssertionError('rebuilt')\n"
        "loader.build = no_build\n"
        f"ops = loader.KernelLoader().load(Path(sys.argv[1]), torch.{NAMES[dtype]})\n"
        "print(ops is not None and ops.dense_attention is not None)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, str(cache_dir)], capture_output=True, text=True
    )
    assert done.returncode == 0 and done.stdout.split() == ["True"], done.stderr[-2000:]
    assert KernelLoader().load(tmp_path, dtype) is not None
    assert list(tmp_path.iterdir()) == []


def test_no_load_enters_torch_once_exit_began(
    kernel: Kernel, cache_dir: Path, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A loader is a daemon thread; interpreter shutdown stops such a thread when it next
    takes the GIL, and inside torch's C++ that aborts the process. Once the exit hook ran, a
    load neither loads the library nor runs the callbacks waiting for it."""
    loader = KernelLoader()
    called: list[Any] = []
    loader.when_loaded(dtype, called.append)
    loader._at_exit()
    assert loader.load(cache_dir, dtype) is None
    assert called == [] and loader.ops(dtype) is None


@pytest.mark.slow
def test_a_process_that_exits_as_its_engine_starts_is_not_aborted() -> None:
    """The kernels load (and, on AMX, the weights are packed) on a thread while the engine
    starts; a script that fails right after must end with its own status, not SIGABRT."""
    script = (
        "from blockserve import LLM\n"
        "LLM(num_gpu_blocks_override=64, max_model_len=256)\n"
        "raise SystemExit(3)\n"
    )
    for _ in range(2):  # the race it guards against took each of 3 runs on an AMX host
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
        assert done.returncode == 3, done.stderr[-2000:]
        assert "terminate called" not in done.stderr


def test_a_build_cut_short_at_exit_leaves_nothing(
    tmp_path: Path, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A server stopped while the kernel builds: the compiler's process group ends and its
    scratch directory goes (the atexit hook), so neither runs on nor litters the cache."""
    target = cpu_build.library_path(tmp_path, dtype)
    failures: list[BaseException] = []
    at_exit: list[functools.partial] = []  # what the build asked to run at exit
    hooks = SimpleNamespace(register=at_exit.append, unregister=lambda hook: None)
    monkeypatch.setattr(cpu_build, "atexit", hooks)

    def run() -> None:
        try:
            cpu_build.build(target, dtype)
        except subprocess.CalledProcessError as error:
            failures.append(error)

    thread = threading.Thread(target=run)
    thread.start()
    deadline = time.monotonic() + 30
    while not at_exit and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(at_exit) == 1
    processes = [at_exit[0].args[0]]
    at_exit[0]()  # the interpreter exits
    thread.join(30)
    assert not thread.is_alive()
    assert len(failures) == 1 and processes[0].returncode == -signal.SIGKILL
    assert list(target.parent.iterdir()) == []
    # SIGKILL reaches the compiler's children at once; they leave the process table shortly.
    deadline = time.monotonic() + 10
    while group_alive(processes[0].pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not group_alive(processes[0].pid)


def group_alive(group: int) -> bool:
    """Whether a live (not zombie) process is left in a process group."""
    found = subprocess.run(["ps", "-o", "stat=", "-g", str(group)], capture_output=True, text=True)
    return any(not state.startswith("Z") for state in found.stdout.split())
