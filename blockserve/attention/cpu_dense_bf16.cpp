// Attention for x86 CPUs with AVX512-BF16: many query rows against one set of keys, each row
// seeing a prefix of them (all, or its own count: a causal or padded row), head dimension 64,
// bfloat16 in, float32 out with each row's log-sum-exp.
//
// Both products use `vdpbf16ps` (bf16 pairs multiplied and summed into float32 lanes), which
// torch's own CPU flash attention does not, so scores are float32 sums of bf16 products (as
// in oneDNN's bf16 matmul) and never rounded to bf16; the probabilities are, for the second
// product, as in every bf16 flash kernel. Online softmax over blocks of 64 keys.
//
//   q [batch, heads, rows, 64], k / v [batch, heads, keys, 64] bf16; lengths: none (every row
//   sees every key) or [batch, rows] integers (row r sees keys 0 .. lengths[b, r] - 1)
//   → out [batch, heads, rows, 64] f32, lse [batch, heads, rows] f32 (natural log of the sum
//   of exp(scale * q·k); a row that sees no key gets 0 and -inf).
//
// K is repacked per call so that one 64-byte load holds one dimension pair of 16 keys; V so
// that one load holds 16 dimensions of a key pair. Each task is (batch, head, 16 rows),
// processed as 4-row tiles whose accumulators stay in registers; key blocks past the task's
// longest row are skipped.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <algorithm>
#include <limits>
#include <tuple>

namespace {

constexpr int64_t kDim = 64;
constexpr int64_t kPairs = kDim / 2;  // bf16 pairs per row: one 32-bit word each
constexpr int64_t kKeyBlock = 64;     // keys per softmax block: 4 groups of 16 lanes
constexpr int64_t kGroups = kKeyBlock / 16;
constexpr int64_t kTaskRows = 16;
constexpr int64_t kTileRows = 4;

// exp(x) for x <= 0 (scores minus their running maximum): 2^(x log2 e) split into an integer
// power, applied by `scalef`, and 2^f for f in [-0.5, 0.5] by its Taylor series to degree 6
// (relative error ~1.2e-7). Arguments below -87 give ~0; -inf gives 0.
inline __m512 exp_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.4426950408889634f));
  const __m512 whole = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, whole);
  __m512 p = _mm512_set1_ps(1.5403530393381606e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146428443e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076284772e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108664821580e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650695910071e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718055994531e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, whole);
}

inline __m512bh as_bh(__m512i v) { return reinterpret_cast<__m512bh>(v); }

// K of one head as [key blocks of 16][32 pairs][16 keys][2]: padding keys are zero.
void pack_keys(const uint16_t* k, int64_t keys, uint16_t* out) {
  const int64_t groups = (keys + 15) / 16;
  std::memset(out, 0, groups * 16 * kDim * sizeof(uint16_t));
  for (int64_t n = 0; n < keys; ++n) {
    uint16_t* group = out + (n / 16) * 16 * kDim;
    for (int64_t i = 0; i < kPairs; ++i) {
      group[(i * 16 + n % 16) * 2] = k[n * kDim + 2 * i];
      group[(i * 16 + n % 16) * 2 + 1] = k[n * kDim + 2 * i + 1];
    }
  }
}

// V of one head as [key pairs][64 dims][2]: padding keys are zero.
void pack_values(const uint16_t* v, int64_t keys, int64_t padded, uint16_t* out) {
  std::memset(out, 0, padded * kDim * sizeof(uint16_t));
  for (int64_t n = 0; n < keys; ++n) {
    uint16_t* pair = out + (n / 2) * 2 * kDim;
    for (int64_t d = 0; d < kDim; ++d) pair[d * 2 + n % 2] = v[n * kDim + d];
  }
}

struct RowState {
  float max[kTaskRows];
  float sum[kTaskRows];
  alignas(64) float out[kTaskRows][kDim];
};

// Scores of a 4-row tile against one block of 64 keys, scaled: scores[row][key].
inline void tile_scores(const uint32_t* q, const uint16_t* kblock, float scale,
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
  const __m512 s = _mm512_set1_ps(scale);
  for (int64_t r = 0; r < kTileRows; ++r)
    for (int64_t g = 0; g < kGroups; ++g)
      _mm512_storeu_ps(scores[r] + g * 16, _mm512_mul_ps(acc[r][g], s));
}

// One 4-row tile through one key block: softmax update, then out += probabilities · V.
// valid[r]: how many of the block's keys row r sees (0 to 64).
void tile_block(const uint32_t* q, const uint16_t* kblock, const uint16_t* vblock,
                const int64_t* valid, float scale, RowState& state, int64_t row0) {
  alignas(64) float scores[kTileRows][kKeyBlock];
  tile_scores(q, kblock, scale, scores);
  alignas(64) uint32_t probs[kTileRows][kKeyBlock / 2];  // bf16 pairs
  for (int64_t r = 0; r < kTileRows; ++r) {
    if (valid[r] <= 0) {  // nothing to see here: no change, no contribution
      std::memset(probs[r], 0, sizeof(probs[r]));
      continue;
    }
    for (int64_t n = valid[r]; n < kKeyBlock; ++n)
      scores[r][n] = -std::numeric_limits<float>::infinity();
    __m512 block_max = _mm512_loadu_ps(scores[r]);
    for (int64_t g = 1; g < kGroups; ++g)
      block_max = _mm512_max_ps(block_max, _mm512_loadu_ps(scores[r] + g * 16));
    const float old_max = state.max[row0 + r];
    const float new_max = std::max(old_max, _mm512_reduce_max_ps(block_max));
    const float rescale = std::exp(old_max - new_max);  // 0 on the first block
    __m512 total = _mm512_setzero_ps();
    __m512 e[kGroups];
    for (int64_t g = 0; g < kGroups; ++g) {
      e[g] = exp_nonpositive(
          _mm512_sub_ps(_mm512_loadu_ps(scores[r] + g * 16), _mm512_set1_ps(new_max)));
      total = _mm512_add_ps(total, e[g]);
    }
    for (int64_t g = 0; g < kGroups; g += 2) {  // 32 probabilities → 32 bf16 in key order
      _mm512_storeu_si512(probs[r] + g * 8,
                          reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(e[g + 1], e[g])));
    }
    state.max[row0 + r] = new_max;
    state.sum[row0 + r] = state.sum[row0 + r] * rescale + _mm512_reduce_add_ps(total);
    const __m512 factor = _mm512_set1_ps(rescale);
    for (int64_t c = 0; c < kDim; c += 16) {
      float* o = state.out[row0 + r] + c;
      _mm512_store_ps(o, _mm512_mul_ps(_mm512_load_ps(o), factor));
    }
  }
  __m512 acc[kTileRows][kDim / 16];
  for (int64_t r = 0; r < kTileRows; ++r)
    for (int64_t c = 0; c < kDim / 16; ++c) acc[r][c] = _mm512_load_ps(state.out[row0 + r] + c * 16);
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
  for (int64_t r = 0; r < kTileRows; ++r)
    for (int64_t c = 0; c < kDim / 16; ++c) _mm512_store_ps(state.out[row0 + r] + c * 16, acc[r][c]);
}

struct Shapes {
  int64_t batch, heads, rows, keys, padded;
};

// One task: rows row_start .. +16 of (batch b, head h) through every key block they see.
void attend_task(const Shapes& n, int64_t b, int64_t h, int64_t row_start, const uint16_t* qp,
                 const uint16_t* kpack, const uint16_t* vpack, const int64_t* lengths,
                 float scale, float* outp, float* lsep) {
  alignas(64) uint16_t qtile[kTaskRows * kDim] = {};
  RowState state;
  const int64_t count = std::min(kTaskRows, n.rows - row_start);
  const int64_t head = b * n.heads + h;
  std::memcpy(qtile, qp + (head * n.rows + row_start) * kDim, count * kDim * sizeof(uint16_t));
  int64_t seen[kTaskRows] = {};  // keys each row sees; padding rows none
  int64_t longest = 0;
  for (int64_t r = 0; r < kTaskRows; ++r) {
    state.max[r] = -std::numeric_limits<float>::infinity();
    state.sum[r] = 0.0f;
    std::memset(state.out[r], 0, sizeof(state.out[r]));
    if (r < count) {
      seen[r] = lengths == nullptr ? n.keys
                                   : std::clamp<int64_t>(lengths[b * n.rows + row_start + r],
                                                         0, n.keys);
    }
    longest = std::max(longest, seen[r]);
  }
  const uint16_t* kbase = kpack + head * n.padded * kDim;
  const uint16_t* vbase = vpack + head * n.padded * kDim;
  for (int64_t block = 0; block < longest; block += kKeyBlock) {
    for (int64_t r0 = 0; r0 < count; r0 += kTileRows) {
      int64_t valid[kTileRows];
      for (int64_t r = 0; r < kTileRows; ++r)
        valid[r] = std::min(kKeyBlock, seen[r0 + r] - block);
      const auto* q32 = reinterpret_cast<const uint32_t*>(qtile + r0 * kDim);
      tile_block(q32, kbase + block * kDim, vbase + block * kDim, valid, scale, state, r0);
    }
  }
  for (int64_t r = 0; r < count; ++r) {
    const int64_t row = head * n.rows + row_start + r;
    const float sum = state.sum[r];
    const float inverse = sum > 0.0f ? 1.0f / sum : 0.0f;
    for (int64_t d = 0; d < kDim; ++d) outp[row * kDim + d] = state.out[r][d] * inverse;
    lsep[row] = sum > 0.0f ? state.max[r] + std::log(sum)
                           : -std::numeric_limits<float>::infinity();
  }
}

std::tuple<at::Tensor, at::Tensor> dense_attention(const at::Tensor& q, const at::Tensor& k,
                                                   const at::Tensor& v,
                                                   const std::optional<at::Tensor>& lengths,
                                                   double scale) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4,
              "q, k, v must be [batch, heads, n, 64]");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k.scalar_type() == at::kBFloat16 &&
                  v.scalar_type() == at::kBFloat16,
              "q, k, v must be bfloat16");
  TORCH_CHECK(q.size(3) == kDim && k.size(3) == kDim && v.size(3) == kDim,
              "head dimension must be 64");
  TORCH_CHECK(k.sizes() == v.sizes() && q.size(0) == k.size(0) && q.size(1) == k.size(1) &&
                  k.size(2) > 0,
              "k and v must match, with the batch and heads of q and at least one key");
  const int64_t keys = k.size(2);
  const Shapes n{q.size(0), q.size(1), q.size(2), keys,
                 (keys + kKeyBlock - 1) / kKeyBlock * kKeyBlock};
  at::Tensor counts;
  if (lengths.has_value()) {
    TORCH_CHECK(lengths->sizes() == at::IntArrayRef({n.batch, n.rows}),
                "lengths must be [batch, rows]");
    counts = lengths->to(at::kLong).contiguous();
  }
  const at::Tensor qc = q.contiguous(), kc = k.contiguous(), vc = v.contiguous();
  const int64_t heads = n.batch * n.heads;
  at::Tensor kpack = at::empty({heads, n.padded * kDim}, k.options());
  at::Tensor vpack = at::empty({heads, n.padded * kDim}, v.options());
  const auto* kp = reinterpret_cast<const uint16_t*>(kc.data_ptr());
  const auto* vp = reinterpret_cast<const uint16_t*>(vc.data_ptr());
  auto* kpp = reinterpret_cast<uint16_t*>(kpack.data_ptr());
  auto* vpp = reinterpret_cast<uint16_t*>(vpack.data_ptr());
  at::parallel_for(0, 2 * heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t h = t / 2;
      if (t % 2 == 0)
        pack_keys(kp + h * keys * kDim, keys, kpp + h * n.padded * kDim);
      else
        pack_values(vp + h * keys * kDim, keys, n.padded, vpp + h * n.padded * kDim);
    }
  });
  at::Tensor out = at::empty({n.batch, n.heads, n.rows, kDim}, q.options().dtype(at::kFloat));
  at::Tensor lse = at::empty({n.batch, n.heads, n.rows}, q.options().dtype(at::kFloat));
  const auto* qp = reinterpret_cast<const uint16_t*>(qc.data_ptr());
  const int64_t* lp = counts.defined() ? counts.data_ptr<int64_t>() : nullptr;
  float* outp = out.data_ptr<float>();
  float* lsep = lse.data_ptr<float>();
  const int64_t per_head = (n.rows + kTaskRows - 1) / kTaskRows;
  const auto fscale = static_cast<float>(scale);
  at::parallel_for(0, heads * per_head, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t head = t / per_head;
      attend_task(n, head / n.heads, head % n.heads, (t % per_head) * kTaskRows, qp, kpp, vpp,
                  lp, fscale, outp, lsep);
    }
  });
  return {out, lse};
}

}  // namespace

TORCH_LIBRARY(blockserve_cpu, m) {
  m.def(
      "dense_attention(Tensor q, Tensor k, Tensor v, Tensor? lengths, float scale)"
      " -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(blockserve_cpu, CPU, m) { m.impl("dense_attention", &dense_attention); }
