// Linear layers of few rows (decode steps) in bf16 on float32 FMAs: y = x · Wᵀ (+ bias),
// bfloat16 in and out, float32 sums rounded once, for CPUs without AMX whose FMAs outrun their
// bf16 dot products (dot_rates.cpp; blockserve/model/weight_copies.py chooses).
//
// On a 2-vCPU AVX512-BF16 Xeon without AMX, oneDNN's bf16 products of a decode step's 16 rows
// over SmolLM2-135M's weights took 54.4 ms, reading them at 5 GB/s where a plain read reaches
// 22-25, and computing at half the rate vdpbf16ps allows there, which is itself half the
// FMAs' (benchmarks/bench_wide_products.py).
// Here the weight is repacked once into panels of 16 columns, [N / 16][K / 2][16][2 bf16]: a
// 64-byte line for each pair of k holds column c's two values in 32-bit lane c, which a shift
// (the even k) and a mask (the odd k) widen into two float32 vectors exactly. x is widened
// once a call, transposed by pairs of k ([k / 2][rows][2], widen_columns) so that a pass's
// broadcasts are one stream; each row then takes two broadcasts and two FMAs per line, up to
// kRows rows a pass (kRows accumulators), the first pass reading the panel from memory, the
// later ones from cache, the next panel fetched into L2 meanwhile (as in linear_f32.cpp, whose
// float32 weights this kernel halves). Two panels a pass (a broadcast for two FMAs) ran
// slower, 12 rows at a time over all of k or 8 over 128 pairs of k at a time.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <optional>

#include "bf16.h"

namespace {

using namespace blockserve_cpu;

constexpr int64_t kPanel = 16;  // columns of W a panel holds
constexpr int64_t kRows = 16;   // the most rows of a pass: 16 accumulators

// W [N, K] row-major bf16 → panels of k pairs: W[p · 16 + c][2j + h] at
// ((p · K / 2 + j) · 16 + c) · 2 + h, a 64-byte line per pair j (vdpbf16ps's order).
at::Tensor vector_pack(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16,
              "vector_pack: the weight must be 2-D bfloat16");
  const int64_t n = weight.size(0), k = weight.size(1);
  TORCH_CHECK(n % 32 == 0 && k % 2 == 0, "vector_pack: [", n, ", ", k,
              "]: rows must be a multiple of 32, columns even");
  const at::Tensor w = weight.contiguous();
  at::Tensor packed = at::empty_like(w);
  const auto* src = reinterpret_cast<const uint16_t*>(w.data_ptr());
  auto* dst = reinterpret_cast<uint16_t*>(packed.data_ptr());
  at::parallel_for(0, n / kPanel, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p)
      for (int64_t i = 0; i < k; ++i)
        for (int64_t c = 0; c < kPanel; ++c)
          dst[((p * k / 2 + i / 2) * kPanel + c) * 2 + i % 2] = src[(p * kPanel + c) * k + i];
  });
  return packed;
}

// Where a pass is: x widened and transposed by pairs of k ([k / 2][rows][2]) at the pass's
// first row, the panel, the next panel to fetch (or none) and which share of its lines this
// pass fetches.
struct Pass {
  const float* x;
  int64_t rows;  // of the whole x: the stride of its k pairs is twice that
  const uint16_t* panel;
  const uint16_t* next;
  int64_t k, passes, pass;
};

// y[R][16] = x[R][k] · panel (+ bias), rounded to bf16: R rows of one pass. A line holds 16
// columns' values at k = 2j (the low halves of its 32-bit lanes) and 2j + 1 (the high ones).
template <int R>
void pass_rows(const Pass& at, const float* bias, uint16_t* y, int64_t y_stride) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  // This pass fetches the next panel's lines pass, pass + passes, ...: a countdown to each.
  int64_t until_fetch = at.next != nullptr ? at.pass : at.k;
  for (int64_t j = 0; j < at.k / 2; ++j) {
    const __m512i line = _mm512_loadu_si512(at.panel + j * 2 * kPanel);
    const __m512 even = pair_firsts(line), odd = pair_seconds(line);
    if (until_fetch-- == 0) {  // the next panel's line j
      _mm_prefetch(reinterpret_cast<const char*>(at.next + j * 2 * kPanel), _MM_HINT_T1);
      until_fetch = at.passes - 1;
    }
    // Row r's k = 2j and 2j + 1 at xj[2r] and xj[2r + 1]: one pointer, constant offsets
    // (with two, the compiler kept an address a row and moved them in and out of registers).
    const float* xj = at.x + 2 * j * at.rows;
    for (int r = 0; r < R; ++r) {
      acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(xj[2 * r]), even, acc[r]);
      acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(xj[2 * r + 1]), odd, acc[r]);
    }
  }
  const __m512 shift = bias != nullptr ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
  for (int r = 0; r < R; ++r) store_bf16(y + r * y_stride, _mm512_add_ps(acc[r], shift));
}

// A pass of `rows` (1 to R) rows.
template <int R>
void pass_any(int64_t rows, const Pass& at, const float* bias, uint16_t* y, int64_t y_stride) {
  if constexpr (R > 1) {
    if (rows < R) return pass_any<R - 1>(rows, at, bias, y, y_stride);
  }
  pass_rows<R>(at, bias, y, y_stride);
}

// x [rows][k] bf16 (row stride `stride`) → out [k / 2][rows][2] float32, exact: each row's pair
// j of k (a 64-bit pair of floats once widened) moves to pair j's run of rows. Blocks of 8 rows
// × 8 pairs: each row's 8 pairs widened into one vector, then the 8 × 8 matrix of 64-bit pairs
// transposed, so that each store is 8 rows of one pair. In place of aten's permute and convert
// (a strided copy), 64 rows through a layer took 0.863 of the time (docs/cpu-kernels.md).
void widen_columns(const uint16_t* x, int64_t rows, int64_t k, int64_t stride, float* out) {
  const int64_t pairs = k / 2;
  const int64_t grain = std::max<int64_t>(1, 1024 / rows);  // some 8K pairs a thread at least
  at::parallel_for(0, (pairs + 7) / 8, grain, [&](int64_t begin, int64_t end) {
    for (int64_t block = begin; block < end; ++block) {
      const int64_t j0 = block * 8, count = std::min<int64_t>(8, pairs - j0);
      const auto elements = static_cast<__mmask16>((1u << (2 * count)) - 1);
      for (int64_t r0 = 0; r0 < rows; r0 += 8) {
        const int64_t live = std::min<int64_t>(8, rows - r0);
        __m512i v[8];
        for (int64_t i = 0; i < 8; ++i) {
          const uint16_t* at = x + (r0 + i) * stride + 2 * j0;
          const __m256i row =
              i < live ? _mm256_maskz_loadu_epi16(elements, at) : _mm256_setzero_si256();
          v[i] = _mm512_slli_epi32(_mm512_cvtepu16_epi32(row), 16);
        }
        // t[2m] holds pairs 0, 2, 4, 6 of rows 2m and 2m + 1 (a 128-bit lane each); t[2m + 1]
        // pairs 1, 3, 5, 7.
        __m512i t[8];
        for (int m = 0; m < 4; ++m) {
          t[2 * m] = _mm512_unpacklo_epi64(v[2 * m], v[2 * m + 1]);
          t[2 * m + 1] = _mm512_unpackhi_epi64(v[2 * m], v[2 * m + 1]);
        }
        const auto mask = static_cast<__mmask8>((1u << live) - 1);
        for (int odd = 0; odd < 2; ++odd) {  // pairs 2L + odd from each 128-bit lane L
          const __m512i low01 = _mm512_shuffle_i64x2(t[odd], t[2 + odd], 0x44);
          const __m512i high01 = _mm512_shuffle_i64x2(t[4 + odd], t[6 + odd], 0x44);
          const __m512i low23 = _mm512_shuffle_i64x2(t[odd], t[2 + odd], 0xEE);
          const __m512i high23 = _mm512_shuffle_i64x2(t[4 + odd], t[6 + odd], 0xEE);
          const __m512i pair[4] = {_mm512_shuffle_i64x2(low01, high01, 0x88),
                                   _mm512_shuffle_i64x2(low01, high01, 0xDD),
                                   _mm512_shuffle_i64x2(low23, high23, 0x88),
                                   _mm512_shuffle_i64x2(low23, high23, 0xDD)};
          for (int lane = 0; lane < 4; ++lane) {
            const int64_t j = j0 + 2 * lane + odd;
            if (j < j0 + count)
              _mm512_mask_storeu_epi64(out + (j * rows + r0) * 2, mask, pair[lane]);
          }
        }
      }
    }
  });
}

//   x [rows, k] bf16 (rows of any stride, unit along k), packed: vector_pack(W) for W [n, k],
//   bias [n] bf16 or none → [rows, n] bf16.
at::Tensor vector_linear(const at::Tensor& x, const at::Tensor& packed,
                         const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && packed.dim() == 2 &&
                  packed.scalar_type() == at::kBFloat16,
              "vector_linear: x [rows, k] and the packed weight [n, k] must be bfloat16");
  const int64_t rows = x.size(0), k = x.size(1), n = packed.size(0);
  TORCH_CHECK(packed.size(1) == k && packed.is_contiguous(), "vector_linear: x has ", k,
              " columns, the weight ", packed.size(1));
  TORCH_CHECK(n % 32 == 0 && k % 2 == 0, "vector_linear: [", n, ", ", k,
              "]: rows must be a multiple of 32, columns even");
  TORCH_CHECK(!bias || (bias->dim() == 1 && bias->size(0) == n &&
                        bias->scalar_type() == at::kBFloat16),
              "vector_linear: bias must be bfloat16 [", n, "]");
  at::Tensor out = at::empty({rows, n}, x.options());
  if (rows == 0) return out;
  const at::Tensor x_rows = x.stride(1) == 1 ? x : x.contiguous();
  at::Tensor columns = at::empty({k / 2, rows, 2}, x.options().dtype(at::kFloat));
  widen_columns(reinterpret_cast<const uint16_t*>(x_rows.data_ptr()), rows, k, x_rows.stride(0),
                columns.data_ptr<float>());
  const at::Tensor shift = bias ? bias->to(at::kFloat).contiguous() : at::Tensor();
  const float* xs = columns.data_ptr<float>();
  const auto* ws = reinterpret_cast<const uint16_t*>(packed.data_ptr());
  const float* bs = bias ? shift.data_ptr<float>() : nullptr;
  auto* ys = reinterpret_cast<uint16_t*>(out.data_ptr());
  const int64_t passes = (rows + kRows - 1) / kRows;
  at::parallel_for(0, n / kPanel, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const uint16_t* panel = ws + p * k * kPanel;
      const uint16_t* next = p + 1 < end ? panel + k * kPanel : nullptr;
      for (int64_t pass = 0; pass < passes; ++pass) {
        const int64_t row0 = pass * kRows;
        const Pass at{xs + 2 * row0, rows, panel, next, k, passes, pass};
        pass_any<kRows>(std::min(kRows, rows - row0), at, bs ? bs + p * kPanel : nullptr,
                        ys + row0 * n + p * kPanel, n);
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(blockserve_cpu, m) {
  m.def("vector_pack(Tensor weight) -> Tensor");
  m.def("vector_linear(Tensor x, Tensor packed, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(blockserve_cpu, CPU, m) {
  m.impl("vector_pack", &vector_pack);
  m.impl("vector_linear", &vector_linear);
}
