// Linear layers of a prefill's rows on AVX512-FP16 FMAs: y = x · Wᵀ (+ bias), bfloat16 in and
// out (or the float32 sums), for CPUs without AMX that have AVX512-FP16, where a half-precision
// FMA does 64 FLOPs in the time a float32 one does 32 (a Xeon's AVX512-BF16 dot product, at
// best, as many as the float32 FMA: dot_rates.cpp).
//
// Half precision has 5 exponent bits to bf16's 8 and 11 significant bits to its 8, so both
// operands are scaled by powers of two (exact) into its range first: each column of W by its
// largest magnitude (once, when packed) and each row of x by its own (each call), so that
// every product term is below 1 in magnitude and a bf16 value becomes its half exactly (unless
// it is under 2^-14 of its row's or column's largest). The sums run in half precision for
// kRun pairs of k at a time (each addition rounds to 2^-11 of the running sum), then float32
// takes them over: the error's root mean square is 0.44-0.66 of that of rounding the exact sum
// to bf16 (tests/kernels/test_half_products.py), where float32 sums all the way leave that
// rounding alone. Runs of 16 pairs gave 0.31-0.45 of it but took 1.16-1.19x the time over the
// default model's products of 64 to 2,048 rows (each run ends in conversions to float32);
// runs of 64, 0.92 of it (random operands at the model's shapes; scratch measurements).
//
// W is packed once into blocks of 64 columns by pairs of k, [N / 64][K / 2][64][2]: a pair's
// 256-byte line holds column c's two values in 32-bit lane c (of four vectors), and the
// broadcast of x's pair (one 32-bit load, no shuffle) times the line gives each lane two
// products of one column: the even k in its low half, the odd in its high half, which
// float32 adds at the end. A micro tile is kRows rows times one block: 24 accumulators.
// A call's rows are cut into chunks of x (as in linear_bf16.cpp), a task one chunk against one
// block, the block read from L2 by each micro tile after the chunk's first.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <tuple>

#include "bf16.h"
#include "tasks.h"

// AVX512-FP16's intrinsics came with g++ 12 and clang 14; an older compiler builds the rest of
// the library, and has_half() says no.
#ifndef BLOCKSERVE_HALF
#if (defined(__clang__) && __clang_major__ >= 14) || (!defined(__clang__) && __GNUC__ >= 12)
#define BLOCKSERVE_HALF 1
#else
#define BLOCKSERVE_HALF 0
#endif
#endif

#define HALF_TARGET __attribute__((target("avx512fp16,avx512f,avx512bw,avx512vl,avx512dq")))

namespace {

using namespace blockserve_cpu;

constexpr int64_t kBlock = 64;                // columns of W a block holds
constexpr int64_t kVectors = kBlock / 16;     // vectors of 16 columns × 2 k in a pair's line
constexpr int64_t kRows = 6;                  // rows of a micro tile
constexpr int64_t kRun = 32;                  // pairs of k summed in half precision at a time
constexpr int64_t kChunkBytes = 256 * 1024;   // the most of x's halves a task's rows span

bool has_half() {
#if BLOCKSERVE_HALF
  return __builtin_cpu_supports("avx512fp16");
#else
  return false;
#endif
}

// The power of two at or above `largest` (1 where it is 0): x / it is below 1 in magnitude.
float scale_for(float largest) {
  if (!(largest > 0.0f)) return largest == 0.0f ? 1.0f : largest;  // NaN stays NaN
  if (std::isinf(largest)) return largest;
  int exponent = 0;
  std::frexp(largest, &exponent);
  return std::ldexp(1.0f, exponent);
}

// W [N, K] bf16 → (the halves of W / scale in blocks of pairs, each column's scale): column
// b · 64 + c's pair j at ((b · K / 2 + j) · 64 + c) · 2.
std::tuple<at::Tensor, at::Tensor> half_pack(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16,
              "half_pack: the weight must be 2-D bfloat16");
  const int64_t n = weight.size(0), k = weight.size(1);
  TORCH_CHECK(n % kBlock == 0 && k % 32 == 0, "half_pack: [", n, ", ", k,
              "] is not a multiple of [64, 32]");
  const at::Tensor w = weight.to(at::kFloat).contiguous();
  at::Tensor packed = at::empty({n, k}, weight.options().dtype(at::kHalf));
  at::Tensor scales = at::empty({n}, weight.options().dtype(at::kFloat));
  const float* src = w.data_ptr<float>();
  auto* dst = packed.data_ptr<at::Half>();
  float* column_scales = scales.data_ptr<float>();
  at::parallel_for(0, n / kBlock, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b)
      for (int64_t c = 0; c < kBlock; ++c) {
        const float* column = src + (b * kBlock + c) * k;
        float largest = 0.0f;
        for (int64_t i = 0; i < k; ++i) largest = std::max(largest, std::fabs(column[i]));
        const float scale = scale_for(largest);
        column_scales[b * kBlock + c] = scale;
        for (int64_t i = 0; i < k; ++i)
          dst[((b * k / 2 + i / 2) * kBlock + c) * 2 + i % 2] = at::Half(column[i] / scale);
      }
  });
  return {packed, scales};
}

// Row r of x (bf16, k values) / its scale into halves at `out`; returns the scale.
float half_row(const uint16_t* row, int64_t k, uint16_t* out) {
  __m512 largest = _mm512_setzero_ps();
  for (int64_t i = 0; i < k; i += 16)
    largest = _mm512_max_ps(largest, _mm512_abs_ps(widen_bf16(row + i)));
  const float scale = scale_for(_mm512_reduce_max_ps(largest));
  const __m512 inverse = _mm512_set1_ps(1.0f / scale);
  for (int64_t i = 0; i < k; i += 16) {
    const __m256i halves =
        _mm512_cvtps_ph(_mm512_mul_ps(widen_bf16(row + i), inverse), _MM_FROUND_TO_NEAREST_INT);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), halves);
  }
  return scale;
}

// kRows rows of halves (`lda` apart) times one block's pairs [pairs][64][2]: each row's sums
// into sums[row][8][16] as float32, column c's even-k sum in lane 2(c % 8) of vector 2(c / 16)
// + (c % 16) / 8 and its odd-k sum beside it.
#if BLOCKSERVE_HALF
HALF_TARGET void micro_tile(const uint16_t* a, int64_t lda, const uint16_t* block,
                            int64_t pairs, float* sums) {
  for (int64_t start = 0; start < pairs; start += kRun) {
    const int64_t end = std::min(pairs, start + kRun);
    __m512h acc[kRows][kVectors];
#pragma GCC unroll 6
    for (int64_t r = 0; r < kRows; ++r)
#pragma GCC unroll 4
      for (int64_t v = 0; v < kVectors; ++v) acc[r][v] = _mm512_setzero_ph();
    for (int64_t j = start; j < end; ++j) {
      const uint16_t* line = block + j * 2 * kBlock;
      __m512h w[kVectors];
#pragma GCC unroll 4
      for (int64_t v = 0; v < kVectors; ++v) w[v] = _mm512_load_ph(line + v * 32);
#pragma GCC unroll 6
      for (int64_t r = 0; r < kRows; ++r) {
        int32_t pair;
        std::memcpy(&pair, a + r * lda + 2 * j, sizeof(pair));
        const __m512h x = _mm512_castsi512_ph(_mm512_set1_epi32(pair));
#pragma GCC unroll 4
        for (int64_t v = 0; v < kVectors; ++v) acc[r][v] = _mm512_fmadd_ph(x, w[v], acc[r][v]);
      }
    }
#pragma GCC unroll 6
    for (int64_t r = 0; r < kRows; ++r)
#pragma GCC unroll 4
      for (int64_t v = 0; v < kVectors; ++v) {
        const __m512i bits = _mm512_castph_si512(acc[r][v]);
        const __m256i low_bits = _mm512_castsi512_si256(bits);
        const __m256i high_bits = _mm512_extracti64x4_epi64(bits, 1);
        const __m512 low = _mm512_cvtxph_ps(_mm256_castsi256_ph(low_bits));
        const __m512 high = _mm512_cvtxph_ps(_mm256_castsi256_ph(high_bits));
        float* out = sums + (r * 2 * kVectors + 2 * v) * 16;
        if (start == 0) {
          _mm512_store_ps(out, low);
          _mm512_store_ps(out + 16, high);
        } else {
          _mm512_store_ps(out, _mm512_add_ps(_mm512_load_ps(out), low));
          _mm512_store_ps(out + 16, _mm512_add_ps(_mm512_load_ps(out + 16), high));
        }
      }
  }
}
#else
void micro_tile(const uint16_t*, int64_t, const uint16_t*, int64_t, float*) {}  // no caller
#endif

// Row `row`'s 16 column sums of vector v from a micro tile's sums (even k plus odd k).
inline __m512 column_sums(const float* sums, int64_t row, int64_t v) {
  const __m512i evens =
      _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i odds = _mm512_add_epi32(evens, _mm512_set1_epi32(1));
  const float* low = sums + (row * 2 * kVectors + 2 * v) * 16;
  const __m512 first = _mm512_load_ps(low), second = _mm512_load_ps(low + 16);
  return _mm512_add_ps(_mm512_permutex2var_ps(first, evens, second),
                       _mm512_permutex2var_ps(first, odds, second));
}

// x [rows, k] bf16 times the packed weight: each row's 16 sums of columns col .. col + 15
// (scaled back, bias added) handed to store(row, col, sums).
template <typename Store>
void half_passes(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                 const std::optional<at::Tensor>& bias, const Store& store) {
  TORCH_CHECK(has_half(), "half_linear: this CPU has no AVX512-FP16 (or g++ built us without)");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.stride(1) == 1,
              "half_linear: x must be [rows, k] bfloat16 of unit column stride");
  const int64_t rows = x.size(0), k = x.size(1), n = packed.size(0);
  TORCH_CHECK(packed.dim() == 2 && packed.scalar_type() == at::kHalf && packed.size(1) == k &&
                  packed.is_contiguous() && n % kBlock == 0 && k % 32 == 0,
              "half_linear: x has ", k, " columns; the packed weight must be half_pack's [n, ",
              k, "], n a multiple of 64, k of 32");
  TORCH_CHECK(scales.dim() == 1 && scales.size(0) == n && scales.scalar_type() == at::kFloat &&
                  scales.is_contiguous(),
              "half_linear: the scales must be half_pack's [", n, "] float32");
  TORCH_CHECK(!bias || (bias->dim() == 1 && bias->size(0) == n), "half_linear: bias must be [",
              n, "]");
  if (rows == 0) return;
  const int64_t padded = (rows + kRows - 1) / kRows * kRows;
  at::Tensor halves = at::empty({padded, k}, x.options().dtype(at::kHalf));
  at::Tensor row_scales = at::empty({padded}, x.options().dtype(at::kFloat));
  auto* hs = reinterpret_cast<uint16_t*>(halves.data_ptr());
  float* rs = row_scales.data_ptr<float>();
  const auto* xs = reinterpret_cast<const uint16_t*>(x.data_ptr());
  const int64_t x_stride = x.stride(0);
  at::parallel_for(0, padded, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      if (r < rows) {
        rs[r] = half_row(xs + r * x_stride, k, hs + r * k);
      } else {
        std::memset(hs + r * k, 0, k * sizeof(uint16_t));
        rs[r] = 1.0f;
      }
  });
  const at::Tensor bias_f32 = bias ? bias->to(at::kFloat).contiguous() : at::Tensor();
  const float* bs = bias ? bias_f32.data_ptr<float>() : nullptr;
  const float* cs = scales.data_ptr<float>();
  const auto* ws = reinterpret_cast<const uint16_t*>(packed.data_ptr());
  const int64_t blocks = n / kBlock;
  // Chunks of rows (a multiple of kRows each) no larger than kChunkBytes of halves, as many as
  // a multiple of the threads where there is more than one.
  const int64_t threads = at::get_num_threads();
  int64_t chunks = (padded * k * 2 + kChunkBytes - 1) / kChunkBytes;
  if (chunks > 1) chunks = (chunks + threads - 1) / threads * threads;
  const int64_t chunk_rows = ((padded + chunks - 1) / chunks + kRows - 1) / kRows * kRows;
  chunks = (padded + chunk_rows - 1) / chunk_rows;
  parallel_tasks(chunks * blocks, [&](int64_t index) {
    alignas(64) float sums[kRows * 2 * kVectors * 16];
    const int64_t b = index % blocks, first_row = index / blocks * chunk_rows;
    const int64_t end_row = std::min(padded, first_row + chunk_rows);
    const uint16_t* block = ws + b * k * kBlock;
    for (int64_t row0 = first_row; row0 < end_row; row0 += kRows) {
      micro_tile(hs + row0 * k, k, block, k / 2, sums);
      for (int64_t r = 0; r < kRows && row0 + r < rows; ++r) {
        const __m512 row_scale = _mm512_set1_ps(rs[row0 + r]);
        for (int64_t v = 0; v < kVectors; ++v) {
          const int64_t col = b * kBlock + v * 16;
          __m512 y = _mm512_mul_ps(_mm512_mul_ps(column_sums(sums, r, v), row_scale),
                                   _mm512_loadu_ps(cs + col));
          if (bs) y = _mm512_add_ps(y, _mm512_loadu_ps(bs + col));
          store(row0 + r, col, y);
        }
      }
    }
  });
}

at::Tensor half_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                       const std::optional<at::Tensor>& bias) {
  const int64_t n = packed.size(0);
  at::Tensor out = at::empty({x.size(0), n}, x.options());
  auto* ys = reinterpret_cast<uint16_t*>(out.data_ptr());
  half_passes(x, packed, scales, bias, [&](int64_t row, int64_t col, __m512 y) {
    store_bf16(ys + row * n + col, y);
  });
  return out;
}

// The float32 sums of the product (no bias), for an operator that rounds them as it reads
// them (silu_and_mul_sums).
at::Tensor half_linear_sums(const at::Tensor& x, const at::Tensor& packed,
                            const at::Tensor& scales) {
  const int64_t n = packed.size(0);
  at::Tensor out = at::empty({x.size(0), n}, x.options().dtype(at::kFloat));
  float* ys = out.data_ptr<float>();
  half_passes(x, packed, scales, std::nullopt, [&](int64_t row, int64_t col, __m512 y) {
    _mm512_storeu_ps(ys + row * n + col, y);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(blockserve_cpu, m) {
  m.def("half_pack(Tensor weight) -> (Tensor, Tensor)");
  m.def("half_linear(Tensor x, Tensor packed, Tensor scales, Tensor? bias) -> Tensor");
  m.def("half_linear_sums(Tensor x, Tensor packed, Tensor scales) -> Tensor");
  m.def("has_half() -> bool", &has_half);
}

TORCH_LIBRARY_IMPL(blockserve_cpu, CPU, m) {
  m.impl("half_pack", &half_pack);
  m.impl("half_linear", &half_linear);
  m.impl("half_linear_sums", &half_linear_sums);
}
