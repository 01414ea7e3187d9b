// Attention for x86 CPUs with AVX512-BF16, head dimension 64, bfloat16 in, float32 out with
// each row's log-sum-exp. Three operators: `dense_attention`, many query rows against one set
// of keys, each row seeing a prefix of them (all, or its own count: a causal or padded row);
// `prefix_attention`, the same with every row seeing all keys of whole blocks read from the
// paged cache (a shared prefix's common blocks); and `paged_decode` (at the end of the file),
// one query token per sequence reading its keys in place from the paged cache.
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

#include "cpu_bf16_common.h"

namespace {

using namespace blockserve_cpu;

constexpr int64_t kDim = 64;
constexpr int64_t kPairs = kDim / 2;  // bf16 pairs per row: one 32-bit word each
constexpr int64_t kKeyBlock = 64;     // keys per softmax block: 4 groups of 16 lanes
constexpr int64_t kGroups = kKeyBlock / 16;
constexpr int64_t kTaskRows = 16;
constexpr int64_t kTileRows = 4;


// K of one head as [key blocks of 16][32 pairs][16 keys][2]: padding keys are zero.
// key_at(n) points at key n's 64 values.
template <typename KeyAt>
void pack_keys(const KeyAt& key_at, int64_t keys, uint16_t* out) {
  const int64_t groups = (keys + 15) / 16;
  std::memset(out, 0, groups * 16 * kDim * sizeof(uint16_t));
  for (int64_t n = 0; n < keys; ++n) {
    const uint16_t* k = key_at(n);
    uint16_t* group = out + (n / 16) * 16 * kDim;
    for (int64_t i = 0; i < kPairs; ++i) {
      group[(i * 16 + n % 16) * 2] = k[2 * i];
      group[(i * 16 + n % 16) * 2 + 1] = k[2 * i + 1];
    }
  }
}

// V of one head as [key pairs][64 dims][2]: padding keys are zero.
template <typename ValueAt>
void pack_values(const ValueAt& value_at, int64_t keys, int64_t padded, uint16_t* out) {
  std::memset(out, 0, padded * kDim * sizeof(uint16_t));
  for (int64_t n = 0; n < keys; ++n) {
    const uint16_t* v = value_at(n);
    uint16_t* pair = out + (n / 2) * 2 * kDim;
    for (int64_t d = 0; d < kDim; ++d) pair[d * 2 + n % 2] = v[d];
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
  float factor[kTileRows];  // what each row's output so far is scaled by
  for (int64_t r = 0; r < kTileRows; ++r) {
    factor[r] = 1.0f;
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
    // ~0 on the first block (exp(-87): the output and sum it scales are 0 then)
    const float rescale =
        _mm512_cvtss_f32(exp_nonpositive(_mm512_set1_ps(old_max - new_max)));
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
    factor[r] = rescale;
  }
  __m512 acc[kTileRows][kDim / 16];
  for (int64_t r = 0; r < kTileRows; ++r) {
    const __m512 scale_by = _mm512_set1_ps(factor[r]);
    for (int64_t c = 0; c < kDim / 16; ++c)
      acc[r][c] = _mm512_mul_ps(_mm512_load_ps(state.out[row0 + r] + c * 16), scale_by);
  }
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
// q_row(b * heads + h, row) points at a query row's 64 values.
template <typename QRow>
void attend_task(const Shapes& n, int64_t b, int64_t h, int64_t row_start, const QRow& q_row,
                 const uint16_t* kpack, const uint16_t* vpack, const int64_t* lengths,
                 float scale, float* outp, float* lsep) {
  alignas(64) uint16_t qtile[kTaskRows * kDim] = {};
  RowState state;
  const int64_t count = std::min(kTaskRows, n.rows - row_start);
  const int64_t head = b * n.heads + h;
  for (int64_t r = 0; r < count; ++r)
    std::memcpy(qtile + r * kDim, q_row(head, row_start + r), kDim * sizeof(uint16_t));
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

// Pack each head's K and V (pack(head, values, out) writes one), then every task.
template <typename QRow, typename Pack>
std::tuple<at::Tensor, at::Tensor> attend_packed(const at::TensorOptions& options,
                                                 const Shapes& n, const QRow& q_row,
                                                 const Pack& pack, const at::Tensor& counts,
                                                 double scale) {
  const int64_t heads = n.batch * n.heads;
  at::Tensor kpack = at::empty({heads, n.padded * kDim}, options);
  at::Tensor vpack = at::empty({heads, n.padded * kDim}, options);
  auto* kpp = reinterpret_cast<uint16_t*>(kpack.data_ptr());
  auto* vpp = reinterpret_cast<uint16_t*>(vpack.data_ptr());
  at::parallel_for(0, 2 * heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      pack(t / 2, t % 2 == 1, (t % 2 == 0 ? kpp : vpp) + (t / 2) * n.padded * kDim);
  });
  at::Tensor out = at::empty({n.batch, n.heads, n.rows, kDim}, options.dtype(at::kFloat));
  at::Tensor lse = at::empty({n.batch, n.heads, n.rows}, options.dtype(at::kFloat));
  const int64_t* lp = counts.defined() ? counts.data_ptr<int64_t>() : nullptr;
  float* outp = out.data_ptr<float>();
  float* lsep = lse.data_ptr<float>();
  const int64_t per_head = (n.rows + kTaskRows - 1) / kTaskRows;
  const auto fscale = static_cast<float>(scale);
  at::parallel_for(0, heads * per_head, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t head = t / per_head;
      attend_task(n, head / n.heads, head % n.heads, (t % per_head) * kTaskRows, q_row, kpp,
                  vpp, lp, fscale, outp, lsep);
    }
  });
  return {out, lse};
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
  const at::Tensor kc = k.contiguous(), vc = v.contiguous();
  const auto* kp = reinterpret_cast<const uint16_t*>(kc.data_ptr());
  const auto* vp = reinterpret_cast<const uint16_t*>(vc.data_ptr());
  const auto pack = [&](int64_t head, bool values, uint16_t* out) {
    const uint16_t* base = (values ? vp : kp) + head * keys * kDim;
    const auto at = [&](int64_t key) { return base + key * kDim; };
    values ? pack_values(at, keys, n.padded, out) : pack_keys(at, keys, out);
  };
  const at::Tensor qc = q.contiguous();
  const auto* qp = reinterpret_cast<const uint16_t*>(qc.data_ptr());
  const auto q_row = [&](int64_t head, int64_t row) { return qp + (head * n.rows + row) * kDim; };
  return attend_packed(q.options(), n, q_row, pack, counts, scale);
}

// What the operators reading the paged cache take: a bf16 q of `q_dims` dimensions (shaped
// as `q_shape` says) and two contiguous bf16 caches [blocks, block_size, kv_heads, 64] of one
// shape.
void check_paged(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                 int64_t q_dims, const char* q_shape) {
  TORCH_CHECK(q.dim() == q_dims && k_cache.dim() == 4 && v_cache.dim() == 4, q_shape,
              " and the caches [blocks, block_size, kv_heads, 64]");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k_cache.scalar_type() == at::kBFloat16 &&
                  v_cache.scalar_type() == at::kBFloat16,
              "q and the caches must be bfloat16");
  TORCH_CHECK(q.size(-1) == kDim && k_cache.size(3) == kDim, "head dimension must be 64");
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes() && k_cache.is_contiguous() &&
                  v_cache.is_contiguous(),
              "the caches must be contiguous and of one shape");
}

// Rows of each KV head against every key of whole blocks of the paged cache, read in place:
// a shared prefix's common blocks, seen by every query of the sequences that share them.
//
//   q [n, kv_heads, m, 64] bf16, any strides but the last (head h's rows are q[:, h] in
//   order: a decode step's query as it is, [sequences, kv_heads, query heads per KV head,
//   64]); k_cache / v_cache [blocks, block_size, kv_heads, 64] bf16; block_ids [b] integers
//   → out [kv_heads, n * m, 64] f32, lse [kv_heads, n * m] f32.
std::tuple<at::Tensor, at::Tensor> prefix_attention(const at::Tensor& q, const at::Tensor& k_cache,
                                                    const at::Tensor& v_cache,
                                                    const at::Tensor& block_ids, double scale) {
  check_paged(q, k_cache, v_cache, 4, "q must be [n, kv_heads, m, 64]");
  TORCH_CHECK(q.stride(3) == 1, "q must have unit stride along its last dimension");
  const int64_t kv_heads = k_cache.size(2), block_size = k_cache.size(1);
  TORCH_CHECK(q.size(1) == kv_heads, "q must have one row set per KV head");
  TORCH_CHECK(block_ids.dim() == 1 && block_ids.numel() > 0, "block_ids must be [n], n >= 1");
  const at::Tensor ids = block_ids.to(at::kLong).contiguous();
  const int64_t* ip = ids.data_ptr<int64_t>();
  for (int64_t b = 0; b < ids.numel(); ++b)
    TORCH_CHECK(ip[b] >= 0 && ip[b] < k_cache.size(0), "a block id is outside the cache");
  const int64_t keys = ids.numel() * block_size;
  const int64_t per_outer = q.size(2);
  const Shapes n{1, kv_heads, q.size(0) * per_outer, keys,
                 (keys + kKeyBlock - 1) / kKeyBlock * kKeyBlock};
  const auto* kp = reinterpret_cast<const uint16_t*>(k_cache.data_ptr());
  const auto* vp = reinterpret_cast<const uint16_t*>(v_cache.data_ptr());
  const auto pack = [&](int64_t head, bool values, uint16_t* out) {
    const uint16_t* base = values ? vp : kp;
    const auto at = [&](int64_t key) {
      return base + ((ip[key / block_size] * block_size + key % block_size) * kv_heads + head) *
                        kDim;
    };
    values ? pack_values(at, keys, n.padded, out) : pack_keys(at, keys, out);
  };
  const auto* qp = reinterpret_cast<const uint16_t*>(q.data_ptr());
  const int64_t outer_stride = q.stride(0), head_stride = q.stride(1), row_stride = q.stride(2);
  const auto q_row = [&](int64_t head, int64_t row) {
    return qp + (row / per_outer) * outer_stride + head * head_stride +
           (row % per_outer) * row_stride;
  };
  auto [out, lse] = attend_packed(q.options(), n, q_row, pack, at::Tensor(), scale);
  return {out.squeeze(0), lse.squeeze(0)};
}

// ---- Paged decode ------------------------------------------------------------------------
// One query token per sequence against its keys where they lie in the paged cache: no gather
// into a workspace, no repacking (each key serves only the G query heads of its KV head, too
// few to pay for either). Per key, each query row's dot product is two `vdpbf16ps` and one
// horizontal sum; softmax runs online over chunks of up to 16 keys of one block; probabilities
// stay float32 and V is widened to float32 for the second product.
//
//   q [seqs, kv_heads * G, 64] bf16; k_cache / v_cache [blocks, block_size, kv_heads, 64]
//   bf16; block_table [seqs, >= blocks used] and lengths [seqs] integers (sequence s reads keys
//   0 .. lengths[s] - 1 of the blocks its table lists, in order); optionally prior_out
//   [seqs, kv_heads, G, 64] and prior_lse [seqs, kv_heads, G] f32, the rows' attention over
//   earlier keys (`prefix_attention`'s over common blocks), which the result then includes
//   → out [seqs, kv_heads * G, 64] f32, lse [seqs, kv_heads * G] f32.

constexpr int64_t kMaxGroup = 8;
constexpr int64_t kChunksAhead = 8;  // chunks of keys requested ahead (1 and 4 measured slower)


struct PagedShapes {
  int64_t kv_heads, block_size, table_stride;
};

// Online-softmax state of one KV head's G query rows.
template <int G>
struct HeadState {
  float max[G], sum[G];
  alignas(64) float acc[G][kDim];
};

// KV head h's G query rows through `count` (1 to 16) keys starting at element `first` of the
// caches (token stride `stride`): softmax update, then acc += probabilities · V.
template <int G>
inline void decode_chunk(const uint16_t* q, const uint16_t* kc, const uint16_t* vc, int64_t first,
                         int64_t count, int64_t stride, float scale, HeadState<G>& state) {
  __m512i query[G][2];
  for (int r = 0; r < G; ++r)
    for (int half = 0; half < 2; ++half)
      query[r][half] = _mm512_loadu_si512(q + r * kDim + half * 32);
  alignas(64) float probs[G][16];
  for (int64_t t = 0; t < 16; ++t) {
    if (t >= count) {
      for (int r = 0; r < G; ++r) probs[r][t] = -std::numeric_limits<float>::infinity();
      continue;
    }
    const uint16_t* key = kc + first + t * stride;
    const __m512i k0 = _mm512_loadu_si512(key), k1 = _mm512_loadu_si512(key + 32);
    for (int r = 0; r < G; ++r) {
      __m512 dot = _mm512_dpbf16_ps(_mm512_setzero_ps(), as_bh(query[r][0]), as_bh(k0));
      dot = _mm512_dpbf16_ps(dot, as_bh(query[r][1]), as_bh(k1));
      probs[r][t] = _mm512_reduce_add_ps(dot) * scale;
    }
  }
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

// Where a decode continues from: the softmax state of its rows over earlier keys (the common
// blocks), as their normalized output and log-sum-exp; strides in elements.
struct Prior {
  const float* out = nullptr;  // [seqs, kv_heads, G, 64], unit stride along the last
  const float* lse = nullptr;  // [seqs, kv_heads, G]
  int64_t out_strides[3] = {}, lse_strides[3] = {};
};

// Sequence s, KV head h: its G query rows through `num_keys` keys, chunk by chunk, with the
// lines of the next kChunksAhead chunks requested before each is worked on, continuing from
// `prior` if it has one. q, out and lse point at the head's first query row.
template <int G>
void decode_task(const PagedShapes& n, const uint16_t* q, const uint16_t* kc, const uint16_t* vc,
                 const int64_t* table, int64_t num_keys, int64_t s, int64_t h, const Prior& prior,
                 float scale, float* out, float* lse) {
  HeadState<G> state;
  std::memset(state.acc, 0, sizeof(state.acc));
  for (int r = 0; r < G; ++r) {
    state.max[r] = -std::numeric_limits<float>::infinity();
    state.sum[r] = 0.0f;
    if (prior.out == nullptr) continue;
    const float seen = prior.lse[s * prior.lse_strides[0] + h * prior.lse_strides[1] +
                                 r * prior.lse_strides[2]];
    if (seen == -std::numeric_limits<float>::infinity()) continue;  // saw no key
    // A normalized output is the state after its keys with their sum of exponentials scaled
    // to 1, the maximum moved to their log-sum-exp.
    state.max[r] = seen;
    state.sum[r] = 1.0f;
    std::memcpy(state.acc[r],
                prior.out + s * prior.out_strides[0] + h * prior.out_strides[1] +
                    r * prior.out_strides[2],
                sizeof(state.acc[r]));
  }
  const int64_t stride = n.kv_heads * kDim;
  const auto chunk_at = [&](int64_t start, int64_t& first) {  // its first element; its length
    const int64_t offset = start % n.block_size;
    first = (table[start / n.block_size] * n.block_size + offset) * stride + h * kDim;
    return std::min({int64_t{16}, n.block_size - offset, num_keys - start});
  };
  // Chunks requested ahead of the one being worked on: a sequence's blocks lie anywhere, so
  // the hardware prefetcher cannot follow them, and one chunk's lines do not cover DRAM's
  // latency.
  int64_t ahead = 0, requested = 0;
  int64_t first = 0;
  for (int64_t start = 0, count = 0; start < num_keys; start += count) {
    for (; ahead < num_keys && requested <= kChunksAhead; ++requested) {
      int64_t at = 0;
      const int64_t length = chunk_at(ahead, at);
      for (int64_t t = 0; t < length; ++t)
        for (int64_t line = 0; line < kDim; line += 32) {  // 64 bytes: 32 bf16
          _mm_prefetch(reinterpret_cast<const char*>(kc + at + t * stride + line), _MM_HINT_T0);
          _mm_prefetch(reinterpret_cast<const char*>(vc + at + t * stride + line), _MM_HINT_T0);
        }
      ahead += length;
    }
    count = chunk_at(start, first);
    --requested;
    decode_chunk<G>(q, kc, vc, first, count, stride, scale, state);
  }
  for (int r = 0; r < G; ++r) {
    const float inverse = state.sum[r] > 0.0f ? 1.0f / state.sum[r] : 0.0f;
    for (int64_t d = 0; d < kDim; ++d) out[r * kDim + d] = state.acc[r][d] * inverse;
    lse[r] = state.sum[r] > 0.0f ? state.max[r] + std::log(state.sum[r])
                                 : -std::numeric_limits<float>::infinity();
  }
}

template <int G>
void decode_all(const PagedShapes& n, int64_t seqs, const uint16_t* q, const uint16_t* kc,
                const uint16_t* vc, const int64_t* table, const int64_t* lengths,
                const Prior& prior, float scale, float* out, float* lse) {
  at::parallel_for(0, seqs * n.kv_heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t s = t / n.kv_heads, h = t % n.kv_heads;
      const int64_t row = (s * n.kv_heads + h) * G;  // the first of its query heads
      decode_task<G>(n, q + row * kDim, kc, vc, table + s * n.table_stride, lengths[s], s, h,
                     prior, scale, out + row * kDim, lse + row);
    }
  });
}

std::tuple<at::Tensor, at::Tensor> paged_decode(const at::Tensor& q, const at::Tensor& k_cache,
                                                const at::Tensor& v_cache,
                                                const at::Tensor& block_table,
                                                const at::Tensor& lengths, double scale,
                                                const std::optional<at::Tensor>& prior_out,
                                                const std::optional<at::Tensor>& prior_lse) {
  check_paged(q, k_cache, v_cache, 3, "q must be [seqs, heads, 64]");
  const int64_t seqs = q.size(0), kv_heads = k_cache.size(2), blocks = k_cache.size(0);
  TORCH_CHECK(q.size(1) % kv_heads == 0 && q.size(1) / kv_heads <= kMaxGroup,
              "query heads must be 1 to 8 per KV head");
  TORCH_CHECK(block_table.dim() == 2 && block_table.size(0) == seqs &&
                  lengths.sizes() == at::IntArrayRef({seqs}),
              "block_table must be [seqs, blocks] and lengths [seqs]");
  const at::Tensor table = block_table.to(at::kLong).contiguous();
  const at::Tensor counts = lengths.to(at::kLong).contiguous();
  const int64_t block_size = k_cache.size(1);
  const int64_t* tp = table.data_ptr<int64_t>();
  const int64_t* lp = counts.data_ptr<int64_t>();
  for (int64_t s = 0; s < seqs; ++s) {  // every key read must lie in the cache
    TORCH_CHECK(lp[s] >= 0 && lp[s] <= table.size(1) * block_size,
                "a sequence's length exceeds its block table");
    for (int64_t b = 0; b < (lp[s] + block_size - 1) / block_size; ++b)
      TORCH_CHECK(tp[s * table.size(1) + b] >= 0 && tp[s * table.size(1) + b] < blocks,
                  "a block id is outside the cache");
  }
  const int64_t group = q.size(1) / kv_heads;
  TORCH_CHECK(prior_out.has_value() == prior_lse.has_value(),
              "prior_out and prior_lse come together");
  Prior prior;
  if (prior_out.has_value()) {
    TORCH_CHECK(prior_out->sizes() == at::IntArrayRef({seqs, kv_heads, group, kDim}) &&
                    prior_lse->sizes() == at::IntArrayRef({seqs, kv_heads, group}),
                "prior_out must be [seqs, kv_heads, group, 64] and prior_lse [seqs, kv_heads, "
                "group]");
    TORCH_CHECK(prior_out->scalar_type() == at::kFloat && prior_lse->scalar_type() == at::kFloat &&
                    prior_out->stride(3) == 1,
                "the prior must be float32, unit stride along the head dimension");
    prior.out = prior_out->data_ptr<float>();
    prior.lse = prior_lse->data_ptr<float>();
    for (int d = 0; d < 3; ++d) {
      prior.out_strides[d] = prior_out->stride(d);
      prior.lse_strides[d] = prior_lse->stride(d);
    }
  }
  const at::Tensor qc = q.contiguous();
  at::Tensor out = at::empty(q.sizes(), q.options().dtype(at::kFloat));
  at::Tensor lse = at::empty({seqs, q.size(1)}, q.options().dtype(at::kFloat));
  const PagedShapes n{kv_heads, block_size, table.size(1)};
  const auto* qp = reinterpret_cast<const uint16_t*>(qc.data_ptr());
  const auto* kp = reinterpret_cast<const uint16_t*>(k_cache.data_ptr());
  const auto* vp = reinterpret_cast<const uint16_t*>(v_cache.data_ptr());
  const auto fscale = static_cast<float>(scale);
  float* outp = out.data_ptr<float>();
  float* lsep = lse.data_ptr<float>();
  switch (group) {
#define BLOCKSERVE_GROUP(G) \
  case G:                   \
    decode_all<G>(n, seqs, qp, kp, vp, tp, lp, prior, fscale, outp, lsep); \
    break;
    BLOCKSERVE_GROUP(1) BLOCKSERVE_GROUP(2) BLOCKSERVE_GROUP(3) BLOCKSERVE_GROUP(4)
    BLOCKSERVE_GROUP(5) BLOCKSERVE_GROUP(6) BLOCKSERVE_GROUP(7) BLOCKSERVE_GROUP(8)
#undef BLOCKSERVE_GROUP
  }
  return {out, lse};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(blockserve_cpu, m) {
  m.def(
      "dense_attention(Tensor q, Tensor k, Tensor v, Tensor? lengths, float scale)"
      " -> (Tensor, Tensor)");
  m.def(
      "prefix_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_ids, float scale)"
      " -> (Tensor, Tensor)");
  m.def(
      "paged_decode(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, Tensor lengths,"
      " float scale, Tensor? prior_out=None, Tensor? prior_lse=None) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(blockserve_cpu, CPU, m) {
  m.impl("dense_attention", &dense_attention);
  m.impl("prefix_attention", &prefix_attention);
  m.impl("paged_decode", &paged_decode);
}
