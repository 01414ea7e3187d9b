// Attention for x86 CPUs with AVX512-BF16: the bfloat16 arithmetic of the operators in
// attention.h (which has their shapes and contracts), bfloat16 in, float32 out.
//
// Both products of dense and prefix attention use `vdpbf16ps` (bf16 pairs multiplied and
// summed into float32 lanes), which torch's own CPU flash attention does not, so scores are
// float32 sums of bf16 products (as in oneDNN's bf16 matmul) and never rounded to bf16; the
// probabilities are, for the second product, as in every bf16 flash kernel. Online softmax
// over blocks of 64 keys. K is packed (per call; a shared prefix's common blocks once, by
// pack_common) so that one 64-byte load holds one dimension pair of 16 keys; V so that one
// load holds 16 dimensions of a key pair. Each task is
// (batch, head, 16 rows), processed as 4-row tiles whose accumulators stay in registers; key
// blocks past the task's longest row are skipped. Where the CPU has AMX-BF16, the same
// operators run both products on AMX tiles instead (AmxKernel below: one task, one tile);
// where its float32 FMAs outrun `vdpbf16ps`, on FMAs over the pairs widened (WideKernel: a
// task's 16 rows through a key block in one call, the block widened once for its 4-row tiles).
//
// Paged decode: per key, each query row's dot product is two `vdpbf16ps`, and a chunk's 16
// keys' sums are reduced together (reduce_rows); probabilities stay float32 and V is widened
// to float32 for the second product.

#include <immintrin.h>

#include <array>

#include "amx.h"
#include "attention.h"
#include "bf16.h"

namespace {

using namespace blockserve_cpu;

constexpr int64_t kPairs = kDim / 2;  // bf16 pairs per row: one 32-bit word each
constexpr int64_t kGroups = kKeyBlock / 16;
constexpr int64_t kTaskRows = 16;
constexpr int64_t kTileRows = 4;

// rows[n] (16 32-bit words each) becomes column n of the 16×16 matrix they form: after two
// rounds of interleaving within 128-bit lanes, each row holds four columns' quarters, and
// a 4×4 exchange of lanes assembles them.
inline void transpose_words(__m512i rows[16]) {
  __m512i t[16], u[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(rows[i], rows[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(rows[i], rows[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {  // u[i + j], lane L: column 4L + j of rows i .. i + 3
    u[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    u[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    u[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    u[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int j = 0; j < 4; ++j) {
    const __m512i v0 = _mm512_shuffle_i32x4(u[j], u[4 + j], 0x44);
    const __m512i v1 = _mm512_shuffle_i32x4(u[j], u[4 + j], 0xEE);
    const __m512i v2 = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0x44);
    const __m512i v3 = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0xEE);
    rows[j] = _mm512_shuffle_i32x4(v0, v2, 0x88);
    rows[4 + j] = _mm512_shuffle_i32x4(v0, v2, 0xDD);
    rows[8 + j] = _mm512_shuffle_i32x4(v1, v3, 0x88);
    rows[12 + j] = _mm512_shuffle_i32x4(v1, v3, 0xDD);
  }
}

// Lane r (r < Rows): op over the 16 lanes of v[r]. Rows reduced together, in four rounds
// that each pair two vectors' lanes (half of each row's values from one, half from the
// other) and apply op, halving the lanes every row has: 45 instructions for 16 rows, where
// reducing each row by itself takes ~8 and a scalar extract each. Vectors that hold only
// rows past Rows are not computed (their lanes come out as don't-cares).
template <int Rows, typename Op>
inline __m512 reduce_rows(const __m512 (&v)[16], Op op) {
  static_assert(Rows >= 1 && Rows <= 16);
  // Lanes taken from x then y (index 16 + i is y's lane i); each round's second half is its
  // first shifted by the width of a row's run.
  const __m512i round1 = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23);
  const __m512i round2 = _mm512_setr_epi32(0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27);
  const __m512i round3 = _mm512_setr_epi32(0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29);
  const __m512i round4 = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const auto halve = [&](__m512 x, __m512 y, __m512i low, int shift) {
    const __m512i high = _mm512_add_epi32(low, _mm512_set1_epi32(shift));
    return op(_mm512_permutex2var_ps(x, low, y), _mm512_permutex2var_ps(x, high, y));
  };
  // Vector i of a round holds rows i * per .. + per - 1: computed only if one is below Rows.
  const auto live = [](int i, int per) { return i * per < Rows; };
  __m512 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i)  // 8 lanes a row, 2 rows a vector
    a[i] = live(i, 2) ? halve(v[2 * i], v[2 * i + 1], round1, 8) : a[0];
  for (int i = 0; i < 4; ++i)  // 4 lanes, 4 rows
    b[i] = live(i, 4) ? halve(a[2 * i], a[2 * i + 1], round2, 4) : b[0];
  for (int i = 0; i < 2; ++i)  // 2 lanes, 8 rows
    c[i] = live(i, 8) ? halve(b[2 * i], b[2 * i + 1], round3, 2) : c[0];
  return halve(c[0], c[1], round4, 1);  // 1 lane, 16 rows: row r at lane r
}

// The online-softmax update of `Rows` (up to 16) rows (state rows row0 ..) by one block of 64
// keys: scores [row][key] (unscaled) become probabilities, rounded to bf16 in key order (the
// second product's left side, [row][key pair]); factor[r] is what row r's output so far
// must be scaled by. valid[r]: how many of the block's keys row r sees (0 to 64); a row that
// sees none is left as it was and contributes nothing. The rows' maxima, sums and rescales
// are found together, a lane a row.
template <int64_t Rows, int64_t StateRows>
void block_softmax(float (*scores)[kKeyBlock], const int64_t* valid, float scale,
                   RowState<StateRows>& state, int64_t row0, uint32_t (*probs)[kKeyBlock / 2],
                   float* factor) {
  static_assert(Rows <= 16);
  constexpr __mmask16 kRows = static_cast<__mmask16>((1u << Rows) - 1);
  __m512 row_max[16];  // each row's maximum in every lane it has: a lane each after reduce_rows
  __mmask16 seeing = 0;
  for (int64_t r = 0; r < 16; ++r) {
    row_max[r] = _mm512_set1_ps(kNegInf);
    if (r >= Rows || valid[r] <= 0) continue;
    seeing |= static_cast<__mmask16>(1u << r);
    for (int64_t n = valid[r]; n < kKeyBlock; ++n) scores[r][n] = kNegInf;
    for (int64_t g = 0; g < kGroups; ++g)
      row_max[r] = _mm512_max_ps(row_max[r], _mm512_loadu_ps(scores[r] + g * 16));
  }
  const auto larger = [](__m512 x, __m512 y) { return _mm512_max_ps(x, y); };
  const __m512 old_max = _mm512_maskz_loadu_ps(kRows, state.max + row0);  // of scaled scores
  const __m512 new_max = _mm512_mask_max_ps(
      old_max, seeing, old_max,
      _mm512_mul_ps(reduce_rows<Rows>(row_max, larger), _mm512_set1_ps(scale)));
  // exp(old - new) where the maximum moved (~0 on a row's first block: what it scales is 0)
  const __mmask16 moved = _mm512_cmp_ps_mask(new_max, old_max, _CMP_NEQ_UQ);
  const __m512 rescale = _mm512_mask_mov_ps(_mm512_set1_ps(1.0f), moved,
                                            exp_nonpositive(_mm512_sub_ps(old_max, new_max)));
  // exp(scale * (score - max)) as 2^(score * scale log2 e - max log2 e): one FMA a vector
  const __m512 to_exponent = _mm512_set1_ps(scale * kLog2E);
  alignas(64) float offset[16];
  _mm512_store_ps(offset, _mm512_mul_ps(new_max, _mm512_set1_ps(-kLog2E)));
  __m512 total[16];
  for (int64_t r = 0; r < 16; ++r) {
    total[r] = _mm512_setzero_ps();
    if (r >= Rows) continue;
    if (!(seeing >> r & 1)) {
      std::memset(probs[r], 0, sizeof(probs[r]));
      continue;
    }
    const __m512 row_offset = _mm512_set1_ps(offset[r]);
    __m512 e[kGroups];
    for (int64_t g = 0; g < kGroups; ++g) {
      e[g] = exp2_nonpositive(
          _mm512_fmadd_ps(_mm512_loadu_ps(scores[r] + g * 16), to_exponent, row_offset));
      total[r] = _mm512_add_ps(total[r], e[g]);
    }
    for (int64_t g = 0; g < kGroups; g += 2)  // 32 probabilities → 32 bf16 in key order
      _mm512_storeu_si512(probs[r] + g * 8,
                          reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(e[g + 1], e[g])));
  }
  const __m512 sums =
      reduce_rows<Rows>(total, [](__m512 x, __m512 y) { return _mm512_add_ps(x, y); });
  const __m512 old_sum = _mm512_maskz_loadu_ps(kRows, state.sum + row0);
  _mm512_mask_storeu_ps(state.sum + row0, kRows, _mm512_fmadd_ps(old_sum, rescale, sums));
  _mm512_mask_storeu_ps(state.max + row0, kRows, new_max);
  _mm512_mask_storeu_ps(factor, kRows, rescale);
}

struct Bf16Kernel {
  using Elem = uint16_t;
  static constexpr at::ScalarType kType = at::kBFloat16;
  static constexpr const char* kTypeName = "bfloat16";
  static constexpr int64_t kTileRows = ::kTileRows, kTaskRows = ::kTaskRows;
  using Paged = Bf16Kernel;  // the policy of the decodes' paged attention (AMX keeps this)

  // K of one head as [key blocks of 16][32 pairs][16 keys][2]: padding keys are zero.
  // key_at(n) points at key n's 64 values. Each block is two 16×16 transposes of 32-bit
  // words (a key's dimension pairs 0-15, then 16-31).
  template <typename KeyAt>
  static void pack_keys(const KeyAt& key_at, int64_t keys, int64_t padded, uint16_t* out) {
    for (int64_t first = 0; first < padded; first += 16) {
      const int64_t count = std::clamp<int64_t>(keys - first, 0, 16);
      uint16_t* group = out + first * kDim;
      for (int64_t half = 0; half < 2; ++half) {
        __m512i rows[16];
        for (int64_t n = 0; n < 16; ++n)
          rows[n] = n < count ? _mm512_loadu_si512(key_at(first + n) + half * 32)
                              : _mm512_setzero_si512();
        transpose_words(rows);
        for (int64_t i = 0; i < 16; ++i)
          _mm512_storeu_si512(group + (half * 16 + i) * 32, rows[i]);
      }
    }
  }

  // V of one head as [key pairs][64 dims][2]: padding keys are zero.
  template <typename ValueAt>
  static void pack_values(const ValueAt& value_at, int64_t keys, int64_t padded, uint16_t* out) {
    // Element i of a pair's 32-dimension run: the first key's dimension i / 2 (index < 32),
    // then the second key's (index 32 + i / 2), alternating.
    alignas(64) static constexpr auto kInterleave = [] {
      std::array<uint16_t, 2 * 32> index{};
      for (int i = 0; i < 32; ++i) {
        index[i] = static_cast<uint16_t>(i / 2 + (i % 2) * 32);
        index[32 + i] = static_cast<uint16_t>(16 + i / 2 + (i % 2) * 32);
      }
      return index;
    }();
    const __m512i low = _mm512_load_si512(kInterleave.data());
    const __m512i high = _mm512_load_si512(kInterleave.data() + 32);
    for (int64_t n = 0; n < padded; n += 2) {
      uint16_t* pair = out + n * kDim;
      for (int64_t half = 0; half < 2; ++half) {
        const __m512i a = n < keys ? _mm512_loadu_si512(value_at(n) + half * 32)
                                   : _mm512_setzero_si512();
        const __m512i b = n + 1 < keys ? _mm512_loadu_si512(value_at(n + 1) + half * 32)
                                       : _mm512_setzero_si512();
        _mm512_storeu_si512(pair + half * 64, _mm512_permutex2var_epi16(a, low, b));
        _mm512_storeu_si512(pair + half * 64 + 32, _mm512_permutex2var_epi16(a, high, b));
      }
    }
  }

  // Scores of a 4-row tile against one block of 64 keys: scores[row][key].
  static void tile_scores(const uint32_t* q, const uint16_t* kblock,
                          float scores[kTileRows][kKeyBlock]) {
    __m512 acc[kTileRows][kGroups];
    for (auto& row : acc)
      for (auto& a : row) a = _mm512_setzero_ps();
    for (int64_t i = 0; i < kPairs; ++i) {
      __m512i keys[kGroups];
      for (int64_t g = 0; g < kGroups; ++g)
        keys[g] = _mm512_loadu_si512(kblock + (g * kPairs + i) * 32);
      for (int64_t r = 0; r < kTileRows; ++r) {
        const __m512i query = _mm512_set1_epi32(static_cast<int>(q[r * kPairs + i]));
        for (int64_t g = 0; g < kGroups; ++g)
          acc[r][g] = _mm512_dpbf16_ps(acc[r][g], as_bh(query), as_bh(keys[g]));
      }
    }
    for (int64_t r = 0; r < kTileRows; ++r)
      for (int64_t g = 0; g < kGroups; ++g) _mm512_storeu_ps(scores[r] + g * 16, acc[r][g]);
  }

  // One 4-row tile through one key block: softmax update, then out += probabilities · V.
  // valid[r]: how many of the block's keys row r sees (0 to 64).
  static void tile_block(const uint16_t* q_bf16, const uint16_t* kblock, const uint16_t* vblock,
                         const int64_t* valid, float scale, RowState<kTaskRows>& state,
                         int64_t row0) {
    const auto* q = reinterpret_cast<const uint32_t*>(q_bf16);  // bf16 pairs
    alignas(64) float scores[kTileRows][kKeyBlock];
    tile_scores(q, kblock, scores);
    alignas(64) uint32_t probs[kTileRows][kKeyBlock / 2];  // bf16 pairs
    float factor[kTileRows];
    block_softmax<kTileRows>(scores, valid, scale, state, row0, probs, factor);
    __m512 acc[kTileRows][kDim / 16];
    for (int64_t r = 0; r < kTileRows; ++r) {
      const __m512 scale_by = _mm512_set1_ps(factor[r]);
      for (int64_t c = 0; c < kDim / 16; ++c)
        acc[r][c] = _mm512_mul_ps(_mm512_load_ps(state.out[row0 + r] + c * 16), scale_by);
    }
    add_values(probs, vblock, acc);
    for (int64_t r = 0; r < kTileRows; ++r)
      for (int64_t c = 0; c < kDim / 16; ++c)
        _mm512_store_ps(state.out[row0 + r] + c * 16, acc[r][c]);
  }

  // acc[r] += row r's probabilities (bf16 pairs, [row][key pair]) · the block's V.
  static void add_values(const uint32_t (&probs)[kTileRows][kKeyBlock / 2],
                         const uint16_t* vblock, __m512 (&acc)[kTileRows][kDim / 16]) {
    for (int64_t j = 0; j < kKeyBlock / 2; ++j) {
      __m512i values[kDim / 16];
      for (int64_t c = 0; c < kDim / 16; ++c)
        values[c] = _mm512_loadu_si512(vblock + (j * kDim + c * 16) * 2);
      for (int64_t r = 0; r < kTileRows; ++r) {
        const __m512i p = _mm512_set1_epi32(static_cast<int>(probs[r][j]));
        for (int64_t c = 0; c < kDim / 16; ++c)
          acc[r][c] = _mm512_dpbf16_ps(acc[r][c], as_bh(p), as_bh(values[c]));
      }
    }
  }

  // KV head h's G query rows through `count` (1 to 16) keys starting at element `first` of the
  // caches (token stride `stride`): softmax update, then acc += probabilities · V.
  template <int G>
  static void decode_chunk(const uint16_t* q, const uint16_t* kc, const uint16_t* vc, int64_t first,
                           int64_t count, int64_t stride, float scale, HeadState<G>& state) {
    __m512i query[G][2];
    for (int r = 0; r < G; ++r)
      for (int half = 0; half < 2; ++half)
        query[r][half] = _mm512_loadu_si512(q + r * kDim + half * 32);
    // dots[r][t]: row r's products with key t in 16 partial sums, reduced for all 16 keys at
    // once (reduce_rows: the lanes of a row's scores are its keys).
    __m512 dots[G][16];
    for (int64_t t = 0; t < 16; ++t) {
      if (t >= count) {
        for (int r = 0; r < G; ++r) dots[r][t] = _mm512_setzero_ps();
        continue;
      }
      const uint16_t* key = kc + first + t * stride;
      const __m512i k0 = _mm512_loadu_si512(key), k1 = _mm512_loadu_si512(key + 32);
      for (int r = 0; r < G; ++r) {
        const __m512 dot = _mm512_dpbf16_ps(_mm512_setzero_ps(), as_bh(query[r][0]), as_bh(k0));
        dots[r][t] = _mm512_dpbf16_ps(dot, as_bh(query[r][1]), as_bh(k1));
      }
    }
    finish_chunk<G>(dots, vc, first, count, stride, scale, state);
  }

  // The rest of decode_chunk once dots[r][t] holds row r's products with key t: the softmax
  // update, then acc += probabilities · V.
  template <int G>
  static void finish_chunk(const __m512 (&dots)[G][16], const uint16_t* vc, int64_t first,
                           int64_t count, int64_t stride, float scale, HeadState<G>& state) {
    const auto sum = [](__m512 x, __m512 y) { return _mm512_add_ps(x, y); };
    const __mmask16 keys = static_cast<__mmask16>((1u << count) - 1);
    alignas(64) float probs[G][16];
    for (int r = 0; r < G; ++r)
      _mm512_store_ps(probs[r], _mm512_mask_mul_ps(_mm512_set1_ps(kNegInf), keys,
                                                   reduce_rows<16>(dots[r], sum),
                                                   _mm512_set1_ps(scale)));
    __m512 acc[G][kDim / 16];
    for (int r = 0; r < G; ++r) {
      const __m512 scores = _mm512_load_ps(probs[r]);
      const float new_max = std::max(state.max[r], _mm512_reduce_max_ps(scores));
      const float rescale =  // ~0 on the first chunk, where what it scales is 0
          _mm512_cvtss_f32(exp_nonpositive(_mm512_set1_ps(state.max[r] - new_max)));
      const __m512 e = exp_nonpositive(_mm512_sub_ps(scores, _mm512_set1_ps(new_max)));
      _mm512_store_ps(probs[r], e);
      state.sum[r] = state.sum[r] * rescale + _mm512_reduce_add_ps(e);
      state.max[r] = new_max;
      const __m512 factor = _mm512_set1_ps(rescale);
      for (int64_t c = 0; c < kDim / 16; ++c)
        acc[r][c] = _mm512_mul_ps(_mm512_load_ps(state.acc[r] + c * 16), factor);
    }
    for (int64_t t = 0; t < count; ++t) {
      const uint16_t* value = vc + first + t * stride;
      __m512 v[kDim / 16];
      for (int64_t c = 0; c < kDim / 16; ++c) v[c] = widen_bf16(value + c * 16);
      for (int r = 0; r < G; ++r) {
        const __m512 p = _mm512_set1_ps(probs[r][t]);
        for (int64_t c = 0; c < kDim / 16; ++c) acc[r][c] = _mm512_fmadd_ps(p, v[c], acc[r][c]);
      }
    }
    for (int r = 0; r < G; ++r)
      for (int64_t c = 0; c < kDim / 16; ++c) _mm512_store_ps(state.acc[r] + c * 16, acc[r][c]);
  }
};

// ---- Widened ------------------------------------------------------------------------------
// Where a core's float32 FMAs outrun its `vdpbf16ps` (a 2-vCPU AVX512-BF16 Xeon without AMX
// issues one dot product of 64 FLOPs where it issues four FMAs of 32: csrc/cpu/dot_rates.cpp),
// both products widen their bf16 pairs to float32 in registers and take two FMAs for each
// dot product: the second elements' product, then the first's, as `vdpbf16ps` adds them, so
// the bits are the same but for denormals (which it flushes). The layouts are Bf16Kernel's.

struct WideKernel : Bf16Kernel {
  // A task's 16 rows through a key block in one call: the block's K and V are widened once
  // for all of them (with 4-row tiles, once a tile) and their softmax runs once, a lane a row.
  static constexpr int64_t kTileRows = 16;
  static constexpr int64_t kSubRows = ::kTileRows;  // rows whose accumulators fit registers
  using Paged = WideKernel;

  // One key block's K, then its V, as float32, in one buffer so that it fits L1 with the rest
  // (two buffers, 32 KB, ran no faster than widening once a tile, bench_ab.py shared-decode):
  // keys[i][h][g] is dimension 2i + h of key group g's 16 keys; values[j][h][c]
  // dimensions 16c .. 16c + 15 of key 2j + h.
  union WideBlock {
    alignas(64) float keys[kPairs][2][kGroups][16];
    alignas(64) float values[kKeyBlock / 2][2][kDim / 16][16];
  };

  static void widen_keys(const uint16_t* kblock, WideBlock& block) {
    for (int64_t i = 0; i < kPairs; ++i)
      for (int64_t g = 0; g < kGroups; ++g) {
        const __m512i words = _mm512_loadu_si512(kblock + (g * kPairs + i) * 32);
        _mm512_store_ps(block.keys[i][0][g], pair_firsts(words));
        _mm512_store_ps(block.keys[i][1][g], pair_seconds(words));
      }
  }

  static void widen_values(const uint16_t* vblock, WideBlock& block) {
    for (int64_t j = 0; j < kKeyBlock / 2; ++j)
      for (int64_t c = 0; c < kDim / 16; ++c) {
        const __m512i words = _mm512_loadu_si512(vblock + (j * kDim + c * 16) * 2);
        _mm512_store_ps(block.values[j][0][c], pair_firsts(words));
        _mm512_store_ps(block.values[j][1][c], pair_seconds(words));
      }
  }

  // Each row's bf16 pairs as float32: firsts[r][i] and seconds[r][i] for pair i of row r.
  template <int64_t Rows, int64_t Pairs>
  static void widen_rows(const uint32_t* pairs, float (*firsts)[Pairs], float (*seconds)[Pairs]) {
    for (int64_t r = 0; r < Rows; ++r)
      for (int64_t i = 0; i < Pairs; i += 16) {
        const __m512i words = _mm512_loadu_si512(pairs + r * Pairs + i);
        _mm512_store_ps(firsts[r] + i, pair_firsts(words));
        _mm512_store_ps(seconds[r] + i, pair_seconds(words));
      }
  }

  // Bf16Kernel::tile_scores over the widened block: each dot product the second elements'
  // product, then the first's, as vdpbf16ps adds them.
  static void tile_scores(const uint32_t* q, const WideBlock& block,
                          float scores[kSubRows][kKeyBlock]) {
    alignas(64) float firsts[kSubRows][kPairs], seconds[kSubRows][kPairs];
    widen_rows<kSubRows, kPairs>(q, firsts, seconds);
    __m512 acc[kSubRows][kGroups];
    for (auto& row : acc)
      for (auto& a : row) a = _mm512_setzero_ps();
    for (int64_t i = 0; i < kPairs; ++i) {
      __m512 key_firsts[kGroups], key_seconds[kGroups];  // loaded once for the rows
      for (int64_t g = 0; g < kGroups; ++g) {
        key_firsts[g] = _mm512_load_ps(block.keys[i][0][g]);
        key_seconds[g] = _mm512_load_ps(block.keys[i][1][g]);
      }
      for (int64_t r = 0; r < kSubRows; ++r) {
        const __m512 first = _mm512_set1_ps(firsts[r][i]), second = _mm512_set1_ps(seconds[r][i]);
        for (int64_t g = 0; g < kGroups; ++g)
          acc[r][g] = _mm512_fmadd_ps(first, key_firsts[g],
                                      _mm512_fmadd_ps(second, key_seconds[g], acc[r][g]));
      }
    }
    for (int64_t r = 0; r < kSubRows; ++r)
      for (int64_t g = 0; g < kGroups; ++g) _mm512_storeu_ps(scores[r] + g * 16, acc[r][g]);
  }

  // Bf16Kernel::add_values over the widened block, each row's probabilities widened.
  static void add_values(const uint32_t (*probs)[kKeyBlock / 2], const WideBlock& block,
                         __m512 (&acc)[kSubRows][kDim / 16]) {
    alignas(64) float firsts[kSubRows][kKeyBlock / 2], seconds[kSubRows][kKeyBlock / 2];
    widen_rows<kSubRows, kKeyBlock / 2>(probs[0], firsts, seconds);
    for (int64_t j = 0; j < kKeyBlock / 2; ++j) {
      __m512 value_firsts[kDim / 16], value_seconds[kDim / 16];  // loaded once for the rows
      for (int64_t c = 0; c < kDim / 16; ++c) {
        value_firsts[c] = _mm512_load_ps(block.values[j][0][c]);
        value_seconds[c] = _mm512_load_ps(block.values[j][1][c]);
      }
      for (int64_t r = 0; r < kSubRows; ++r) {
        const __m512 first = _mm512_set1_ps(firsts[r][j]), second = _mm512_set1_ps(seconds[r][j]);
        for (int64_t c = 0; c < kDim / 16; ++c)
          acc[r][c] = _mm512_fmadd_ps(first, value_firsts[c],
                                      _mm512_fmadd_ps(second, value_seconds[c], acc[r][c]));
      }
    }
  }

  // The task's 16 rows through one key block (row0 is always 0): a 4-row tile of rows that
  // all see none of its keys is skipped (a causal task's last blocks, a task's padding rows).
  static void tile_block(const uint16_t* q_bf16, const uint16_t* kblock, const uint16_t* vblock,
                         const int64_t* valid, float scale, RowState<kTaskRows>& state,
                         int64_t /*row0*/) {
    const auto* q = reinterpret_cast<const uint32_t*>(q_bf16);  // bf16 pairs
    WideBlock block;
    widen_keys(kblock, block);
    bool seen[kTileRows / kSubRows];
    alignas(64) float scores[kTileRows][kKeyBlock];
    for (int64_t t = 0; t < kTileRows / kSubRows; ++t) {
      seen[t] = *std::max_element(valid + t * kSubRows, valid + (t + 1) * kSubRows) > 0;
      if (seen[t]) tile_scores(q + t * kSubRows * kPairs, block, scores + t * kSubRows);
    }
    alignas(64) uint32_t probs[kTileRows][kKeyBlock / 2];  // bf16 pairs
    float factor[kTileRows];
    block_softmax<kTileRows>(scores, valid, scale, state, 0, probs, factor);
    widen_values(vblock, block);
    for (int64_t t = 0; t < kTileRows / kSubRows; ++t) {
      if (!seen[t]) continue;  // its rows' factors are 1
      __m512 acc[kSubRows][kDim / 16];
      for (int64_t r = 0; r < kSubRows; ++r) {
        const __m512 scale_by = _mm512_set1_ps(factor[t * kSubRows + r]);
        for (int64_t c = 0; c < kDim / 16; ++c)
          acc[r][c] =
              _mm512_mul_ps(_mm512_load_ps(state.out[t * kSubRows + r] + c * 16), scale_by);
      }
      add_values(probs + t * kSubRows, block, acc);
      for (int64_t r = 0; r < kSubRows; ++r)
        for (int64_t c = 0; c < kDim / 16; ++c)
          _mm512_store_ps(state.out[t * kSubRows + r] + c * 16, acc[r][c]);
    }
  }

  // Bf16Kernel::decode_chunk with the scores' products widened (its second product is float32
  // already): each key's 32 pairs widened once for the G rows.
  template <int G>
  static void decode_chunk(const uint16_t* q, const uint16_t* kc, const uint16_t* vc, int64_t first,
                           int64_t count, int64_t stride, float scale, HeadState<G>& state) {
    __m512 query[G][2][2];  // [row][dimension half][pair firsts, pair seconds]
    for (int r = 0; r < G; ++r)
      for (int half = 0; half < 2; ++half) {
        const __m512i words = _mm512_loadu_si512(q + r * kDim + half * 32);
        query[r][half][0] = pair_firsts(words);
        query[r][half][1] = pair_seconds(words);
      }
    __m512 dots[G][16];
    for (int64_t t = 0; t < 16; ++t) {
      if (t >= count) {
        for (int r = 0; r < G; ++r) dots[r][t] = _mm512_setzero_ps();
        continue;
      }
      const uint16_t* key = kc + first + t * stride;
      __m512 widened[2][2];
      for (int half = 0; half < 2; ++half) {
        const __m512i words = _mm512_loadu_si512(key + half * 32);
        widened[half][0] = pair_firsts(words);
        widened[half][1] = pair_seconds(words);
      }
      for (int r = 0; r < G; ++r) {
        __m512 dot = _mm512_setzero_ps();
        for (int half = 0; half < 2; ++half)
          dot = _mm512_fmadd_ps(query[r][half][0], widened[half][0],
                                _mm512_fmadd_ps(query[r][half][1], widened[half][1], dot));
        dots[r][t] = dot;
      }
    }
    finish_chunk<G>(dots, vc, first, count, stride, scale, state);
  }
};

// ---- AMX ---------------------------------------------------------------------------------
// Where the CPU has AMX-BF16 (Sapphire Rapids and later), dense and prefix attention run both
// products on its tiles: 16 rows through a 64-key block is 8 tile products for the scores
// (2 dimension halves × 4 groups of 16 keys) and 8 for probabilities · V, where vdpbf16ps
// takes 512 instructions for each. K and V are packed as for vdpbf16ps: a 16-key group of K
// ([32 pairs][16 keys][2]) is two B tiles as it lies, V ([key pairs][64 dims][2]) gives a B
// tile per 16 dimensions and 16 key pairs at a 256-byte stride. The softmax between the
// products is block_softmax's, so the two paths differ only in the order of float32 sums.
// Paged decode keeps vdpbf16ps: a KV head's 1 to 8 query rows fill too little of a tile.

struct AmxKernel : Bf16Kernel {
  static constexpr int64_t kTileRows = 16, kTaskRows = 16;

  // Tiles 0-3: four 16×16 float32 results; 4-5: the left side's two 32-element halves;
  // 6-7: the right side's two 16-pair halves.
  using Scope = TileScope;  // around each thread's tasks

  // The task's 16 rows through one key block (row0 is always 0: a task is one tile).
  static void tile_block(const uint16_t* q, const uint16_t* kblock, const uint16_t* vblock,
                         const int64_t* valid, float scale, RowState<kTaskRows>& state,
                         int64_t /*row0*/) {
    alignas(64) float scores[kTileRows][kKeyBlock];
    _tile_loadd(4, q, kDim * sizeof(uint16_t));       // dimensions 0-31 of each row
    _tile_loadd(5, q + 32, kDim * sizeof(uint16_t));  // 32-63
    // Tile G = q · K of the block's G-th 16 keys (their dimension pairs 0-15, then 16-31).
    // The intrinsics take tile numbers as literals, hence macros.
#define BLOCKSERVE_SCORES(G)                                          \
  _tile_zero(G);                                                      \
  _tile_loadd(6, kblock + G * 16 * kDim, 64);                         \
  _tile_loadd(7, kblock + G * 16 * kDim + 16 * 32, 64);               \
  _tile_dpbf16ps(G, 4, 6);                                            \
  _tile_dpbf16ps(G, 5, 7);                                            \
  _tile_stored(G, scores[0] + G * 16, kKeyBlock * sizeof(float));
    BLOCKSERVE_SCORES(0) BLOCKSERVE_SCORES(1) BLOCKSERVE_SCORES(2) BLOCKSERVE_SCORES(3)
#undef BLOCKSERVE_SCORES
    alignas(64) uint32_t probs[kTileRows][kKeyBlock / 2];
    float factor[kTileRows];
    block_softmax<kTileRows>(scores, valid, scale, state, 0, probs, factor);
    for (int64_t r = 0; r < kTileRows; ++r) {
      if (factor[r] == 1.0f) continue;
      const __m512 scale_by = _mm512_set1_ps(factor[r]);
      for (int64_t c = 0; c < kDim / 16; ++c)
        _mm512_store_ps(state.out[r] + c * 16,
                        _mm512_mul_ps(_mm512_load_ps(state.out[r] + c * 16), scale_by));
    }
    _tile_loadd(4, probs[0], kKeyBlock * sizeof(uint16_t));       // keys 0-31 of each row
    _tile_loadd(5, probs[0] + 16, kKeyBlock * sizeof(uint16_t));  // keys 32-63
    // Tile C = out (rescaled above) + P · V for dimensions C * 16 .. + 15 (key pairs 0-15,
    // then 16-31: V's rows lie 256 bytes apart).
#define BLOCKSERVE_VALUES(C)                                                   \
  _tile_loadd(C, state.out[0] + C * 16, kDim * sizeof(float));                 \
  _tile_loadd(6, vblock + C * 16 * 2, kDim * 2 * sizeof(uint16_t));            \
  _tile_loadd(7, vblock + (16 * kDim + C * 16) * 2, kDim * 2 * sizeof(uint16_t)); \
  _tile_dpbf16ps(C, 4, 6);                                                     \
  _tile_dpbf16ps(C, 5, 7);                                                     \
  _tile_stored(C, state.out[0] + C * 16, kDim * sizeof(float));
    BLOCKSERVE_VALUES(0) BLOCKSERVE_VALUES(1) BLOCKSERVE_VALUES(2) BLOCKSERVE_VALUES(3)
#undef BLOCKSERVE_VALUES
  }
};

// Widened products in use where wanted (use_wide_attention) and the tiles are not.
std::atomic<bool> wide_wanted{false};

// run(K{}) for the policy the bf16 products take now: AMX tiles, widened, or vdpbf16ps.
template <class Run>
decltype(auto) with_policy(const Run& run) {
  if (use_tiles()) return run(AmxKernel{});
  if (wide_wanted.load(std::memory_order_relaxed)) return run(WideKernel{});
  return run(Bf16Kernel{});
}

std::tuple<at::Tensor, at::Tensor> dense_attention_bf16(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const std::optional<at::Tensor>& lengths, double scale,
    const std::optional<at::Tensor>& prior_out, const std::optional<at::Tensor>& prior_lse) {
  return with_policy([&]<class K>(K) {
    return dense_attention<K>(q, k, v, lengths, scale, prior_out, prior_lse);
  });
}

std::tuple<at::Tensor, at::Tensor> prefix_attention_bf16(
    const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
    const at::Tensor& block_ids, double scale, const std::optional<at::Tensor>& packed) {
  return with_policy([&]<class K>(K) {
    return prefix_attention<K>(q, k_cache, v_cache, block_ids, scale, packed);
  });
}

std::tuple<at::Tensor, at::Tensor> paged_decode_bf16(
    const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
    const at::Tensor& block_table, const at::Tensor& lengths, double scale,
    const std::optional<at::Tensor>& prior_out, const std::optional<at::Tensor>& prior_lse) {
  return with_policy([&]<class K>(K) {
    return paged_decode<typename K::Paged>(q, k_cache, v_cache, block_table, lengths, scale,
                                           prior_out, prior_lse);
  });
}

at::Tensor decode_attention_bf16(const at::Tensor& q, const at::Tensor& k_cache,
                                 const at::Tensor& v_cache, const at::Tensor& own_tables,
                                 const at::Tensor& own_lengths, double scale,
                                 const std::optional<at::Tensor>& common_ids,
                                 const std::optional<at::Tensor>& packed) {
  return with_policy([&]<class K>(K) {
    return decode_attention<K, typename K::Paged>(q, k_cache, v_cache, own_tables, own_lengths,
                                                  scale, common_ids, packed);
  });
}

// Switch the tiles in or out (tests and benchmarks compare the two paths); whether they are
// now in use: never where the CPU has no AMX-BF16.
bool use_amx(bool wanted) {
  tiles_wanted.store(wanted, std::memory_order_relaxed);
  return use_tiles();
}

// Switch the widened products in or out (in where widening pays:
// blockserve/model/weight_copies.py); whether they are now in use: not where the tiles are.
bool use_wide_attention(bool wanted) {
  wide_wanted.store(wanted, std::memory_order_relaxed);
  return wanted && !use_tiles();
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(blockserve_cpu, m) {
  define_attention(m);
  m.def("use_amx(bool wanted) -> bool", &use_amx);
  m.def("use_wide_attention(bool wanted) -> bool", &use_wide_attention);
}

TORCH_LIBRARY_IMPL(blockserve_cpu, CPU, m) {
  m.impl("dense_attention", &dense_attention_bf16);
  m.impl("prefix_attention", &prefix_attention_bf16);
  m.impl("pack_common", &pack_common<Bf16Kernel>);  // the tiles read the same layout
  m.impl("paged_decode", &paged_decode_bf16);
  m.impl("decode_attention", &decode_attention_bf16);
}
