// Linear layers of few rows over GGUF's quantized weights: y = x · Wᵀ (+ bias), bfloat16 x and
// y, the weight in its Q4_0, Q4_1 or Q8_0 blocks of 32, integer products, float32 sums.
//
// One user's decode step reads every weight once for one row: it is bound by memory, and a Q4
// block of 32 weights is 18 or 20 bytes where bf16 is 64. Decoding each weight to float costs
// more than reading it (measured: 4-8 GB/s of blocks on two cores), so the products are in
// integers, as llama.cpp computes them: x is rounded per block of 32 to int8 with a float
// scale (Q8_0: d = max|x| / 127, q = round-to-even(x / d)), and each AVX512-VNNI instruction
// sums sixteen columns × four products. The result is x's rounded values times the weight's
// exact values, up to the order of the float32 sums: Σ_blocks d_w · d_x · Σ q_w · q_x, plus
// for Q4 the offset m_w · Σ x (m = −8 d for Q4_0), Σ x taken from the rounded x.
//
// gguf_pack reorders the file's blocks once, keeping every bit of them: per 16 columns and
// block of 32, one record of the 16 scales (f16), the 16 offsets (f16; Q4) or the 16 sums of
// the weights (int32; Q8_0, which needs them to take x as unsigned bytes), then the weights,
// four k of one column in each 32-bit lane, so one load serves sixteen columns, its nibbles
// unpacked once for up to eight rows of x. The records of 16 columns are one sequential run;
// threads take runs of 16-column groups.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "bf16.h"
#include "tasks.h"

namespace {

using namespace blockserve_cpu;

constexpr int64_t kBlock = 32;  // weights per block, in every type here
constexpr int64_t kGroup = 16;  // columns per record
constexpr int64_t kRowGroup = 8;  // rows of x per pass over a record
constexpr int64_t kPrefetchBytes = 4096;  // how far ahead of its products a stream is fetched

// GGML's type numbers.
enum QuantType : int64_t { kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8 };

int64_t file_block_bytes(int64_t qtype) {
  switch (qtype) {
    case kQ4_0: return 18;  // f16 d, 16 bytes of nibbles (byte j: weight j low, j + 16 high)
    case kQ4_1: return 20;  // f16 d, f16 m, 16 bytes of nibbles
    case kQ8_0: return 34;  // f16 d, 32 int8
    default: return 0;
  }
}

// A packed record: 16 d (f16), then 16 m (f16) for Q4 or 16 Σw (int32) for Q8_0, then the
// weights: Q4, 4 × 64 bytes, load i's lane c holding k 8i..8i+3 of column c in its low
// nibbles and k 8i+4..8i+7 in its high ones; Q8_0, 8 × 64 bytes, load i's lane c holding k
// 4i..4i+3.
constexpr int64_t record_bytes(int64_t qtype) {
  return qtype == kQ8_0 ? 32 + 64 + 512 : 32 + 32 + 256;
}

uint16_t f16_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, sizeof bits);
  return bits;
}

uint16_t minus_eight_times(uint16_t half) {
  return c10::Half(-8.0f * static_cast<float>(c10::Half(half, c10::Half::from_bits()))).x;
}

// The weight (column c, k j of block b) of a file row, as its integer (Q4: 0..15).
int weight_at(const uint8_t* row, int64_t qtype, int64_t b, int64_t j) {
  const int64_t bytes = file_block_bytes(qtype);
  const uint8_t* block = row + b * bytes;
  if (qtype == kQ8_0) return static_cast<int8_t>(block[2 + j]);
  const uint8_t* qs = block + (qtype == kQ4_1 ? 4 : 2);
  return j < 16 ? qs[j] & 0x0F : qs[j - 16] >> 4;
}

at::Tensor gguf_pack(const at::Tensor& weight, int64_t qtype) {
  const int64_t bytes = file_block_bytes(qtype);
  TORCH_CHECK(bytes > 0, "gguf_pack: GGML type ", qtype, " is not one of Q4_0 (2), Q4_1 (3), Q8_0 (8)");
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kByte && weight.is_contiguous(),
              "gguf_pack: the weight must be contiguous uint8 [n, blocks · bytes]");
  const int64_t n = weight.size(0), row_bytes = weight.size(1);
  TORCH_CHECK(n % kGroup == 0 && row_bytes % bytes == 0, "gguf_pack: ", n,
              " rows are not a multiple of 16, or ", row_bytes, " bytes not of ", bytes, "-byte blocks");
  const int64_t blocks = row_bytes / bytes, rec = record_bytes(qtype);
  at::Tensor packed = at::empty({n / kGroup, blocks * rec}, weight.options());
  const uint8_t* src = weight.data_ptr<uint8_t>();
  uint8_t* dst = packed.data_ptr<uint8_t>();
  at::parallel_for(0, n / kGroup, 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g)
      for (int64_t b = 0; b < blocks; ++b) {
        uint8_t* out = dst + (g * blocks + b) * rec;
        for (int64_t c = 0; c < kGroup; ++c) {
          const uint8_t* row = src + (g * kGroup + c) * row_bytes;
          const uint8_t* block = row + b * bytes;
          std::memcpy(out + 2 * c, block, 2);  // d
          if (qtype == kQ8_0) {
            int32_t sum = 0;
            for (int64_t j = 0; j < kBlock; ++j) sum += weight_at(row, qtype, b, j);
            std::memcpy(out + 32 + 4 * c, &sum, 4);
            for (int64_t j = 0; j < kBlock; ++j)
              out[96 + (j / 4) * 64 + 4 * c + j % 4] = static_cast<uint8_t>(weight_at(row, qtype, b, j));
          } else {
            // Q4_0's offset is −8 d: exact in f16 (a power of two times d).
            const uint16_t m = qtype == kQ4_1 ? f16_at(block + 2) : minus_eight_times(f16_at(block));
            std::memcpy(out + 32 + 2 * c, &m, 2);
            for (int64_t i = 0; i < 4; ++i)
              for (int64_t t = 0; t < 4; ++t)
                out[64 + i * 64 + 4 * c + t] = static_cast<uint8_t>(
                    weight_at(row, qtype, b, 8 * i + t) | weight_at(row, qtype, b, 8 * i + 4 + t) << 4);
          }
        }
      }
  });
  return packed;
}

// x rounded per block of 32: q (int8, or q + 128 as unsigned bytes for Q8_0 weights), its
// scale d, and Σ x of the rounded values (d · Σ q). Kept per thread, reused call to call: a
// decode step's product is too short to allocate tensors for them.
struct QuantizedRows {
  std::vector<uint8_t> q;
  std::vector<float> scale, sums;
};

void quantize_rows(const uint16_t* x, int64_t rows, int64_t k, bool unsigned_bytes,
                   QuantizedRows& out) {
  const int64_t blocks = k / kBlock;
  out.q.resize(rows * k);
  out.scale.resize(rows * blocks);
  out.sums.resize(rows * blocks);
  constexpr int kRound = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  for (int64_t i = 0; i < rows * blocks; ++i) {
    const __m512 lo = widen_bf16(x + i * kBlock), hi = widen_bf16(x + i * kBlock + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
    const float d = amax / 127.0f, inverse = d != 0.0f ? 1.0f / d : 0.0f;
    const __m512 scale = _mm512_set1_ps(inverse);
    __m512i q_lo = _mm512_cvtps_epi32(_mm512_roundscale_ps(_mm512_mul_ps(lo, scale), kRound));
    __m512i q_hi = _mm512_cvtps_epi32(_mm512_roundscale_ps(_mm512_mul_ps(hi, scale), kRound));
    const int sum = _mm512_reduce_add_epi32(_mm512_add_epi32(q_lo, q_hi));
    if (unsigned_bytes) {
      q_lo = _mm512_add_epi32(q_lo, _mm512_set1_epi32(128));
      q_hi = _mm512_add_epi32(q_hi, _mm512_set1_epi32(128));
    }
    _mm_storeu_si128(reinterpret_cast<__m128i*>(&out.q[i * kBlock]), _mm512_cvtepi32_epi8(q_lo));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(&out.q[i * kBlock + 16]), _mm512_cvtepi32_epi8(q_hi));
    out.scale[i] = d;
    out.sums[i] = d * static_cast<float>(sum);
  }
}

inline __m512 halves(const uint8_t* p) {  // 16 f16 → 16 f32
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

inline __m512i quad(const uint8_t* x) {  // four bytes of x in every lane
  int32_t v;
  std::memcpy(&v, x, 4);
  return _mm512_set1_epi32(v);
}

// One group of 16 columns (its `blocks` records at w) against `Rows` rows of rounded x: the
// float32 sums, 16 per row, into acc.
template <int64_t QType, int Rows>
void group(const uint8_t* w, int64_t blocks, const uint8_t* xq, const float* xd, const float* xs,
           int64_t k, __m512* acc) {
  constexpr int64_t rec = record_bytes(QType);
  for (int r = 0; r < Rows; ++r) acc[r] = _mm512_setzero_ps();
  const __m512i low = _mm512_set1_epi8(0x0F);
  for (int64_t b = 0; b < blocks; ++b, w += rec) {
    for (int64_t line = 0; line < rec; line += 64) _mm_prefetch(reinterpret_cast<const char*>(w) + kPrefetchBytes + line, _MM_HINT_T0);
    const __m512 d = halves(w);
    __m512i sums[Rows];
    for (int r = 0; r < Rows; ++r) sums[r] = _mm512_setzero_si512();
    if constexpr (QType == kQ8_0) {
      for (int64_t i = 0; i < 8; ++i) {
        const __m512i v = _mm512_loadu_si512(w + 96 + 64 * i);
        for (int r = 0; r < Rows; ++r)
          sums[r] = _mm512_dpbusd_epi32(sums[r], quad(xq + r * k + b * kBlock + 4 * i), v);
      }
      const __m512i wsum = _mm512_slli_epi32(_mm512_loadu_si512(w + 32), 7);  // 128 Σw
      for (int r = 0; r < Rows; ++r) {
        const __m512 dot = _mm512_cvtepi32_ps(_mm512_sub_epi32(sums[r], wsum));
        acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(xd[r * blocks + b])), dot, acc[r]);
      }
    } else {
      for (int64_t i = 0; i < 4; ++i) {
        const __m512i v = _mm512_loadu_si512(w + 64 + 64 * i);
        const __m512i lo = _mm512_and_si512(v, low);
        const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
        for (int r = 0; r < Rows; ++r) {
          const uint8_t* xr = xq + r * k + b * kBlock + 8 * i;
          sums[r] = _mm512_dpbusd_epi32(sums[r], lo, quad(xr));
          sums[r] = _mm512_dpbusd_epi32(sums[r], hi, quad(xr + 4));
        }
      }
      const __m512 m = halves(w + 32);
      for (int r = 0; r < Rows; ++r) {
        const __m512 dot = _mm512_cvtepi32_ps(sums[r]);
        acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(xd[r * blocks + b])), dot, acc[r]);
        acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(xs[r * blocks + b]), acc[r]);
      }
    }
  }
}

template <int64_t QType>
void groups(const uint8_t* w, int64_t blocks, int64_t g_begin, int64_t g_end, const QuantizedRows& x,
            int64_t rows, int64_t k, const float* bias, int64_t n, uint16_t* y) {
  const uint8_t* xq = x.q.data();
  const float* xd = x.scale.data();
  const float* xs = x.sums.data();
  __m512 acc[kRowGroup];
  for (int64_t g = g_begin; g < g_end; ++g) {
    const uint8_t* wg = w + g * blocks * record_bytes(QType);
    const __m512 add = bias ? _mm512_loadu_ps(bias + g * kGroup) : _mm512_setzero_ps();
    for (int64_t r0 = 0; r0 < rows; r0 += kRowGroup) {
      const int64_t count = std::min(kRowGroup, rows - r0);
      const uint8_t* q = xq + r0 * k;
      const float* d = xd + r0 * blocks;
      const float* s = xs + r0 * blocks;
      switch (count) {
        case 1: group<QType, 1>(wg, blocks, q, d, s, k, acc); break;
        case 2: group<QType, 2>(wg, blocks, q, d, s, k, acc); break;
        case 3: group<QType, 3>(wg, blocks, q, d, s, k, acc); break;
        case 4: group<QType, 4>(wg, blocks, q, d, s, k, acc); break;
        case 5: group<QType, 5>(wg, blocks, q, d, s, k, acc); break;
        case 6: group<QType, 6>(wg, blocks, q, d, s, k, acc); break;
        case 7: group<QType, 7>(wg, blocks, q, d, s, k, acc); break;
        default: group<QType, 8>(wg, blocks, q, d, s, k, acc); break;
      }
      for (int64_t r = 0; r < count; ++r)
        store_bf16(y + (r0 + r) * n + g * kGroup, _mm512_add_ps(acc[r], add));
    }
  }
}

at::Tensor gguf_linear(const at::Tensor& x, const at::Tensor& packed, int64_t qtype,
                       const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(file_block_bytes(qtype) > 0, "gguf_linear: GGML type ", qtype,
              " is not one of Q4_0 (2), Q4_1 (3), Q8_0 (8)");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16,
              "gguf_linear: x must be [rows, k] bfloat16");
  TORCH_CHECK(packed.dim() == 2 && packed.scalar_type() == at::kByte && packed.is_contiguous(),
              "gguf_linear: the weight must be gguf_pack's contiguous uint8 [n / 16, bytes]");
  const int64_t rows = x.size(0), k = x.size(1), n = packed.size(0) * kGroup;
  const int64_t blocks = k / kBlock;
  TORCH_CHECK(k % kBlock == 0 && packed.size(1) == blocks * record_bytes(qtype), "gguf_linear: x has ",
              k, " columns, the weight's records ", packed.size(1), " bytes");
  TORCH_CHECK(!bias || (bias->dim() == 1 && bias->size(0) == n), "gguf_linear: bias must be [", n, "]");
  at::Tensor out = at::empty({rows, n}, x.options());
  if (rows == 0 || n == 0) return out;
  const at::Tensor left = x.contiguous();
  thread_local QuantizedRows rounded;  // this caller's; the workers read it through `xq`
  QuantizedRows& xq = rounded;
  quantize_rows(reinterpret_cast<const uint16_t*>(left.data_ptr()), rows, k, qtype == kQ8_0, xq);
  const at::Tensor bias_f32 = bias ? bias->to(at::kFloat).contiguous() : at::Tensor();
  const float* bp = bias ? bias_f32.data_ptr<float>() : nullptr;
  const auto* wp = packed.data_ptr<uint8_t>();
  auto* yp = reinterpret_cast<uint16_t*>(out.data_ptr());
  parallel_tasks(n / kGroup, [&](int64_t g) {
    switch (qtype) {
      case kQ4_0: groups<kQ4_0>(wp, blocks, g, g + 1, xq, rows, k, bp, n, yp); break;
      case kQ4_1: groups<kQ4_1>(wp, blocks, g, g + 1, xq, rows, k, bp, n, yp); break;
      default: groups<kQ8_0>(wp, blocks, g, g + 1, xq, rows, k, bp, n, yp); break;
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(blockserve_cpu, m) {
  m.def("gguf_pack(Tensor weight, int qtype) -> Tensor");
  m.def("gguf_linear(Tensor x, Tensor packed, int qtype, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(blockserve_cpu, CPU, m) {
  m.impl("gguf_pack", &gguf_pack);
  m.impl("gguf_linear", &gguf_linear);
}
