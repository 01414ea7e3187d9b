// Attention for x86 CPUs with AVX2 and FMA: the float32 arithmetic of the operators in
// cpu_attention.h (which has their shapes and contracts). Built for every x86-64 host this
// project runs on, so that models served in float32 (hosts without native bf16) get the
// same operators as bf16 ones: a shared prefix's common blocks and each decode's own blocks
// read in place, no gather, no float32 score matrix in memory.
//
// Dense and prefix attention: both products are a 6-row × 16-column register tile (12
// accumulators, two 8-lane loads and six broadcasts per step of the inner dimension), the
// shape that keeps the two FMA pipes fed from registers. K is repacked per call as
// [blocks of 16 keys][64 dims][16 keys], so one step of the score product loads one dimension
// of 16 keys; V is copied as it is, [keys][64], where one step of the output product loads 16
// dimensions of one key. Online softmax over blocks of 64 keys; probabilities stay float32.
// Each task is (batch, head, 24 rows), processed as 6-row tiles.
//
// Paged decode: per key, each query row's dot product is eight FMAs and one horizontal sum.

#include <immintrin.h>

#include "cpu_attention.h"
#include "cpu_f32_common.h"

namespace {

using namespace blockserve_cpu;

constexpr int64_t kTileRows = 6;
constexpr int64_t kTaskRows = 24;
constexpr int64_t kColumns = 16;  // a tile's columns: keys of the score product, dims of the other

// c[6][16] = a[6][depth] · b[depth][16], plus what c held scaled per row by `factor` where
// there is one: a's rows `a_stride` apart, b's rows `b_stride` apart, c's `c_stride`.
inline void tile_product(const float* a, int64_t a_stride, const float* b, int64_t b_stride,
                         int64_t depth, const float* factor, float* c, int64_t c_stride) {
  __m256 acc[kTileRows][2];
  for (int64_t r = 0; r < kTileRows; ++r)
    for (int64_t h = 0; h < 2; ++h)
      acc[r][h] = factor == nullptr ? _mm256_setzero_ps()
                                    : _mm256_mul_ps(_mm256_loadu_ps(c + r * c_stride + h * kLanes),
                                                    _mm256_set1_ps(factor[r]));
  for (int64_t i = 0; i < depth; ++i) {
    const __m256 b0 = _mm256_loadu_ps(b + i * b_stride);
    const __m256 b1 = _mm256_loadu_ps(b + i * b_stride + kLanes);
    for (int64_t r = 0; r < kTileRows; ++r) {
      const __m256 x = _mm256_broadcast_ss(a + r * a_stride + i);
      acc[r][0] = _mm256_fmadd_ps(x, b0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(x, b1, acc[r][1]);
    }
  }
  for (int64_t r = 0; r < kTileRows; ++r)
    for (int64_t h = 0; h < 2; ++h) _mm256_storeu_ps(c + r * c_stride + h * kLanes, acc[r][h]);
}

struct F32Kernel {
  using Elem = float;
  static constexpr at::ScalarType kType = at::kFloat;
  static constexpr const char* kTypeName = "float32";
  static constexpr int64_t kTileRows = ::kTileRows, kTaskRows = ::kTaskRows;

  // K of one head as [blocks of 16 keys][64 dims][16 keys]: padding keys of the last block of
  // 16 are zero (keys past it, up to `padded`, are never unmasked).
  template <typename KeyAt>
  static void pack_keys(const KeyAt& key_at, int64_t keys, int64_t /*padded*/, float* out) {
    const int64_t groups = (keys + kColumns - 1) / kColumns;
    if (keys % kColumns) {
      std::memset(out + (groups - 1) * kColumns * kDim, 0, kColumns * kDim * sizeof(float));
    }
    for (int64_t n = 0; n < keys; ++n) {
      const float* k = key_at(n);
      float* group = out + (n / kColumns) * kColumns * kDim + n % kColumns;
      for (int64_t d = 0; d < kDim; ++d) group[d * kColumns] = k[d];
    }
  }

  // V of one head as it is, [keys][64], padding keys zero.
  template <typename ValueAt>
  static void pack_values(const ValueAt& value_at, int64_t keys, int64_t padded, float* out) {
    for (int64_t n = 0; n < keys; ++n)
      std::memcpy(out + n * kDim, value_at(n), kDim * sizeof(float));
    std::memset(out + keys * kDim, 0, (padded - keys) * kDim * sizeof(float));
  }

  // One 6-row tile through one key block: softmax update, then out += probabilities · V.
  // valid[r]: how many of the block's keys row r sees (0 to 64).
  static void tile_block(const float* q, const float* kblock, const float* vblock,
                         const int64_t* valid, float scale, RowState<kTaskRows>& state,
                         int64_t row0) {
    alignas(64) float scores[kTileRows][kKeyBlock];  // then the probabilities
    for (int64_t g = 0; g < kKeyBlock / kColumns; ++g) {
      tile_product(q, kDim, kblock + g * kColumns * kDim, kColumns, kDim, nullptr,
                   &scores[0][g * kColumns], kKeyBlock);
    }
    float factor[kTileRows];  // what each row's output so far is scaled by
    for (int64_t r = 0; r < kTileRows; ++r) {
      factor[r] = 1.0f;
      if (valid[r] <= 0) {  // nothing to see here: no change, no contribution
        std::memset(scores[r], 0, sizeof(scores[r]));
        continue;
      }
      const __m256 s = _mm256_set1_ps(scale);
      __m256 block_max = _mm256_set1_ps(kNegInf);
      for (int64_t c = 0; c < kKeyBlock; c += kLanes) {
        const __m256 x = _mm256_mul_ps(_mm256_load_ps(scores[r] + c), s);
        _mm256_store_ps(scores[r] + c, x);
        if (c + kLanes <= valid[r]) block_max = _mm256_max_ps(block_max, x);
      }
      float new_max = std::max(state.max[row0 + r], max_lanes(block_max));
      for (int64_t n = valid[r] / kLanes * kLanes; n < valid[r]; ++n)
        new_max = std::max(new_max, scores[r][n]);
      const float rescale = std::exp(state.max[row0 + r] - new_max);  // 0 on the first block
      __m256 total = _mm256_setzero_ps();
      for (int64_t c = 0; c < kKeyBlock; c += kLanes) {
        const __m256 e = exp_nonpositive(
            _mm256_sub_ps(_mm256_load_ps(scores[r] + c), _mm256_set1_ps(new_max)));
        _mm256_store_ps(scores[r] + c, e);
      }
      for (int64_t n = valid[r]; n < kKeyBlock; ++n) scores[r][n] = 0.0f;  // masked keys
      for (int64_t c = 0; c < kKeyBlock; c += kLanes)
        total = _mm256_add_ps(total, _mm256_load_ps(scores[r] + c));
      state.max[row0 + r] = new_max;
      state.sum[row0 + r] = state.sum[row0 + r] * rescale + sum_lanes(total);
      factor[r] = rescale;
    }
    for (int64_t c = 0; c < kDim; c += kColumns) {
      tile_product(&scores[0][0], kKeyBlock, vblock + c, kDim, kKeyBlock, factor,
                   state.out[row0] + c, kDim);
    }
  }

  // KV head h's G query rows through `count` (1 to 16) keys starting at element `first` of the
  // caches (token stride `stride`): softmax update, then acc += probabilities · V.
  template <int G>
  static void decode_chunk(const float* q, const float* kc, const float* vc, int64_t first,
                           int64_t count, int64_t stride, float scale, HeadState<G>& state) {
    alignas(32) float probs[G][16];
    for (int64_t t = 0; t < 16; ++t) {
      if (t >= count) {
        for (int r = 0; r < G; ++r) probs[r][t] = kNegInf;
        continue;
      }
      const float* key = kc + first + t * stride;
      __m256 k[kDim / kLanes];
      for (int64_t c = 0; c < kDim / kLanes; ++c) k[c] = _mm256_loadu_ps(key + c * kLanes);
      for (int r = 0; r < G; ++r) {
        __m256 dot0 = _mm256_mul_ps(_mm256_loadu_ps(q + r * kDim), k[0]);
        __m256 dot1 = _mm256_mul_ps(_mm256_loadu_ps(q + r * kDim + kLanes), k[1]);
        for (int64_t c = 2; c < kDim / kLanes; c += 2) {
          dot0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + r * kDim + c * kLanes), k[c], dot0);
          dot1 = _mm256_fmadd_ps(_mm256_loadu_ps(q + r * kDim + (c + 1) * kLanes), k[c + 1], dot1);
        }
        probs[r][t] = sum_lanes(_mm256_add_ps(dot0, dot1)) * scale;
      }
    }
    for (int r = 0; r < G; ++r) {
      const __m256 s0 = _mm256_load_ps(probs[r]), s1 = _mm256_load_ps(probs[r] + kLanes);
      const float new_max = std::max(state.max[r], max_lanes(_mm256_max_ps(s0, s1)));
      const float rescale = std::exp(state.max[r] - new_max);  // 0 on the first chunk
      const __m256 m = _mm256_set1_ps(new_max);
      _mm256_store_ps(probs[r], exp_nonpositive(_mm256_sub_ps(s0, m)));
      _mm256_store_ps(probs[r] + kLanes, exp_nonpositive(_mm256_sub_ps(s1, m)));
      for (int64_t t = count; t < 16; ++t) probs[r][t] = 0.0f;
      state.sum[r] = state.sum[r] * rescale +
                     sum_lanes(_mm256_add_ps(_mm256_load_ps(probs[r]),
                                             _mm256_load_ps(probs[r] + kLanes)));
      state.max[r] = new_max;
      const __m256 factor = _mm256_set1_ps(rescale);
      for (int64_t c = 0; c < kDim; c += kLanes)
        _mm256_store_ps(state.acc[r] + c, _mm256_mul_ps(_mm256_load_ps(state.acc[r] + c), factor));
    }
    for (int64_t t = 0; t < count; ++t) {
      const float* value = vc + first + t * stride;
      __m256 v[kDim / kLanes];
      for (int64_t c = 0; c < kDim / kLanes; ++c) v[c] = _mm256_loadu_ps(value + c * kLanes);
      for (int r = 0; r < G; ++r) {
        const __m256 p = _mm256_set1_ps(probs[r][t]);
        for (int64_t c = 0; c < kDim / kLanes; ++c) {
          float* acc = state.acc[r] + c * kLanes;
          _mm256_store_ps(acc, _mm256_fmadd_ps(p, v[c], _mm256_load_ps(acc)));
        }
      }
    }
  }
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(blockserve_cpu_f32, m) { define_attention(m); }

TORCH_LIBRARY_IMPL(blockserve_cpu_f32, CPU, m) { implement_attention<F32Kernel>(m); }
