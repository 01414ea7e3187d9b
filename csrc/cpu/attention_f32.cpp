// Attention for x86 CPUs in float32: the arithmetic of the operators in attention.h
// (which has their shapes and contracts), on `Vec` (f32.h): eight lanes with AVX2
// and FMA, the build for every x86-64 host this project runs on, sixteen in the build for
// hosts with AVX-512F. Models served in float32 (hosts without native bf16) get the same
// operators as bf16 ones: a shared prefix's common blocks and each decode's own blocks read
// in place, no gather, no float32 score matrix in memory.
//
// Dense and prefix attention: both products are a 6-row × (2 vectors) register tile (12
// accumulators, two loads and six broadcasts per step of the inner dimension), the shape
// that keeps the two FMA pipes fed from registers. K is repacked per call as [groups of 16
// keys][64 dims][16 keys], so one step of the score product loads one dimension of 16 keys
// (of 32 keys, two groups, with sixteen lanes): both builds pack alike, and a packing kept
// across steps serves either. V is copied as it is, [keys][64], where one step of the output
// product loads 2 vectors of dimensions of one key. Online softmax over blocks of 64 keys;
// probabilities stay float32. Each task is (batch, head, 24 rows), processed as 6-row tiles.
//
// Paged decode: per key, each query row's dot product is FMAs over its 64 dimensions and one
// horizontal sum.

#include <immintrin.h>

#include "attention.h"
#include "f32.h"

namespace {

using namespace blockserve_cpu;

constexpr int64_t kTileRows = 6;
constexpr int64_t kTaskRows = 24;
constexpr int64_t kKeyGroup = 16;  // keys a packed group of K holds, side by side
constexpr int64_t kWidth = Vec::kLanes;
constexpr int64_t kColumns = 2 * kWidth;  // a tile's: keys of the score product, dims of the other
// Where a score tile's second vector of keys lies in packed K: in the same group (eight
// lanes), or the next group (sixteen).
constexpr int64_t kSecondKeys = kWidth < kKeyGroup ? kWidth : kKeyGroup * kDim;

// c[6][2 vectors] = a[6][depth] · b[depth][2 vectors], plus what c held scaled per row by
// `factor` where there is one: a's rows `a_stride` apart, b's rows `b_stride` apart and its
// second vector `b_second` after its first, c's rows `c_stride` apart.
inline void tile_product(const float* a, int64_t a_stride, const float* b, int64_t b_stride,
                         int64_t b_second, int64_t depth, const float* factor, float* c,
                         int64_t c_stride) {
  Vec::T acc[kTileRows][2];
  for (int64_t r = 0; r < kTileRows; ++r)
    for (int64_t h = 0; h < 2; ++h)
      acc[r][h] = factor == nullptr
                      ? Vec::zero()
                      : Vec::mul(Vec::load(c + r * c_stride + h * kWidth), Vec::set1(factor[r]));
  for (int64_t i = 0; i < depth; ++i) {
    const Vec::T b0 = Vec::load(b + i * b_stride);
    const Vec::T b1 = Vec::load(b + i * b_stride + b_second);
    for (int64_t r = 0; r < kTileRows; ++r) {
      const Vec::T x = Vec::set1(a[r * a_stride + i]);
      acc[r][0] = Vec::fmadd(x, b0, acc[r][0]);
      acc[r][1] = Vec::fmadd(x, b1, acc[r][1]);
    }
  }
  for (int64_t r = 0; r < kTileRows; ++r)
    for (int64_t h = 0; h < 2; ++h) Vec::store(c + r * c_stride + h * kWidth, acc[r][h]);
}

struct F32Kernel {
  using Elem = float;
  static constexpr at::ScalarType kType = at::kFloat;
  static constexpr const char* kTypeName = "float32";
  static constexpr int64_t kTileRows = ::kTileRows, kTaskRows = ::kTaskRows;

  // K of one head as [groups of 16 keys][64 dims][16 keys], keys past the last up to
  // `padded` zero.
  template <typename KeyAt>
  static void pack_keys(const KeyAt& key_at, int64_t keys, int64_t padded, float* out) {
    const int64_t whole = keys / kKeyGroup * kKeyGroup;  // keys in full groups
    std::memset(out + whole * kDim, 0, (padded - whole) * kDim * sizeof(float));
    for (int64_t n = 0; n < keys; ++n) {
      const float* k = key_at(n);
      float* group = out + (n / kKeyGroup) * kKeyGroup * kDim + n % kKeyGroup;
      for (int64_t d = 0; d < kDim; ++d) group[d * kKeyGroup] = k[d];
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
    for (int64_t key = 0; key < kKeyBlock; key += kColumns) {
      tile_product(q, kDim, kblock + key * kDim, kKeyGroup, kSecondKeys, kDim, nullptr,
                   &scores[0][key], kKeyBlock);
    }
    float factor[kTileRows];  // what each row's output so far is scaled by
    for (int64_t r = 0; r < kTileRows; ++r) {
      factor[r] = 1.0f;
      if (valid[r] <= 0) {  // nothing to see here: no change, no contribution
        std::memset(scores[r], 0, sizeof(scores[r]));
        continue;
      }
      const Vec::T s = Vec::set1(scale);
      Vec::T block_max = Vec::set1(kNegInf);
      for (int64_t c = 0; c < kKeyBlock; c += kWidth) {
        const Vec::T x = Vec::mul(Vec::load(scores[r] + c), s);
        Vec::store(scores[r] + c, x);
        if (c + kWidth <= valid[r]) block_max = Vec::max(block_max, x);
      }
      float new_max = std::max(state.max[row0 + r], Vec::max_of(block_max));
      for (int64_t n = valid[r] / kWidth * kWidth; n < valid[r]; ++n)
        new_max = std::max(new_max, scores[r][n]);
      const float rescale = std::exp(state.max[row0 + r] - new_max);  // 0 on the first block
      const Vec::T m = Vec::set1(new_max);
      for (int64_t c = 0; c < kKeyBlock; c += kWidth)
        Vec::store(scores[r] + c, Vec::exp(Vec::sub(Vec::load(scores[r] + c), m)));
      for (int64_t n = valid[r]; n < kKeyBlock; ++n) scores[r][n] = 0.0f;  // masked keys
      Vec::T total = Vec::zero();
      for (int64_t c = 0; c < kKeyBlock; c += kWidth)
        total = Vec::add(total, Vec::load(scores[r] + c));
      state.max[row0 + r] = new_max;
      state.sum[row0 + r] = state.sum[row0 + r] * rescale + Vec::sum(total);
      factor[r] = rescale;
    }
    for (int64_t c = 0; c < kDim; c += kColumns) {
      tile_product(&scores[0][0], kKeyBlock, vblock + c, kDim, kWidth, kKeyBlock, factor,
                   state.out[row0] + c, kDim);
    }
  }

  // KV head h's G query rows through `count` (1 to 16) keys starting at element `first` of the
  // caches (token stride `stride`): softmax update, then acc += probabilities · V.
  template <int G>
  static void decode_chunk(const float* q, const float* kc, const float* vc, int64_t first,
                           int64_t count, int64_t stride, float scale, HeadState<G>& state) {
    constexpr int64_t kChunk = 16, kDimVectors = kDim / kWidth;
    alignas(64) float probs[G][kChunk];
    for (int64_t t = 0; t < kChunk; ++t) {
      if (t >= count) {
        for (int r = 0; r < G; ++r) probs[r][t] = kNegInf;
        continue;
      }
      const float* key = kc + first + t * stride;
      Vec::T k[kDimVectors];
      for (int64_t c = 0; c < kDimVectors; ++c) k[c] = Vec::load(key + c * kWidth);
      for (int r = 0; r < G; ++r) {  // two sums, the dimensions' vectors taken alternately
        Vec::T dot0 = Vec::mul(Vec::load(q + r * kDim), k[0]);
        Vec::T dot1 = Vec::mul(Vec::load(q + r * kDim + kWidth), k[1]);
        for (int64_t c = 2; c < kDimVectors; c += 2) {
          dot0 = Vec::fmadd(Vec::load(q + r * kDim + c * kWidth), k[c], dot0);
          dot1 = Vec::fmadd(Vec::load(q + r * kDim + (c + 1) * kWidth), k[c + 1], dot1);
        }
        probs[r][t] = Vec::sum(Vec::add(dot0, dot1)) * scale;
      }
    }
    for (int r = 0; r < G; ++r) {
      Vec::T chunk_max = Vec::load(probs[r]);
      for (int64_t c = kWidth; c < kChunk; c += kWidth)
        chunk_max = Vec::max(chunk_max, Vec::load(probs[r] + c));
      const float new_max = std::max(state.max[r], Vec::max_of(chunk_max));
      const float rescale = std::exp(state.max[r] - new_max);  // 0 on the first chunk
      const Vec::T m = Vec::set1(new_max);
      for (int64_t c = 0; c < kChunk; c += kWidth)
        Vec::store(probs[r] + c, Vec::exp(Vec::sub(Vec::load(probs[r] + c), m)));
      for (int64_t t = count; t < kChunk; ++t) probs[r][t] = 0.0f;
      Vec::T total = Vec::load(probs[r]);
      for (int64_t c = kWidth; c < kChunk; c += kWidth)
        total = Vec::add(total, Vec::load(probs[r] + c));
      state.sum[r] = state.sum[r] * rescale + Vec::sum(total);
      state.max[r] = new_max;
      const Vec::T factor = Vec::set1(rescale);
      for (int64_t c = 0; c < kDim; c += kWidth)
        Vec::store(state.acc[r] + c, Vec::mul(Vec::load(state.acc[r] + c), factor));
    }
    for (int64_t t = 0; t < count; ++t) {
      const float* value = vc + first + t * stride;
      Vec::T v[kDimVectors];
      for (int64_t c = 0; c < kDimVectors; ++c) v[c] = Vec::load(value + c * kWidth);
      for (int r = 0; r < G; ++r) {
        const Vec::T p = Vec::set1(probs[r][t]);
        for (int64_t c = 0; c < kDimVectors; ++c) {
          float* acc = state.acc[r] + c * kWidth;
          Vec::store(acc, Vec::fmadd(p, v[c], Vec::load(acc)));
        }
      }
    }
  }
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(BLOCKSERVE_F32_OPS, m) { define_attention(m); }

TORCH_LIBRARY_IMPL(BLOCKSERVE_F32_OPS, CPU, m) { implement_attention<F32Kernel>(m); }
