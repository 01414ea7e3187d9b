// The parts of our CPU attention operators that do not depend on the element type: argument
// checks, the split into tasks across threads, the paged cache's addressing, online-softmax
// state. Each library (attention_bf16.cpp for bfloat16 with AVX512-BF16, attention_f32.cpp
// for float32 with AVX2) supplies the arithmetic as a kernel policy K:
//
//   using Elem;                         uint16_t (bf16 bits) or float
//   kType, kTypeName                    its at::ScalarType and its name in errors
//   kTileRows, kTaskRows                rows worked on together; rows a task takes (a multiple)
//   pack_keys(key_at, keys, padded, out), pack_values(key_at, keys, padded, out)
//                                       one head's K / V in the layout tile_block reads
//   tile_block(q, kblock, vblock, valid, scale, state, row0)
//                                       kTileRows query rows through one block of kKeyBlock
//                                       keys: softmax update, then out += probabilities · V
//   decode_chunk<G>(q, k_cache, v_cache, first, count, stride, scale, state)
//                                       G query rows through 1 to 16 keys read in place
//   Scope (optional)                    held by each thread around its dense and prefix tasks
//
// Tasks are split across threads by tasks.h (a thread whose run is done takes others' tasks).
//
// Three operators: `dense_attention`, many query rows against one set of keys, each row
// seeing a prefix of them (all, or its own count: a causal or padded row);
// `prefix_attention`, the same with every row seeing all keys of whole blocks read from the
// paged cache (a shared prefix's common blocks); and `paged_decode`, one query token per
// sequence reading its keys in place from the paged cache. Head dimension 64; out float32
// with each row's log-sum-exp.
//
// Everything here has internal linkage: each library keeps its own copy, compiled for its
// own instruction set.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <tuple>
#include <vector>

#include "tasks.h"

namespace blockserve_cpu {
namespace {

constexpr int64_t kDim = 64;
constexpr int64_t kKeyBlock = 64;  // keys per softmax block of dense and prefix attention
constexpr int64_t kMaxGroup = 8;   // query heads per KV head that paged_decode takes
constexpr int64_t kChunksAhead = 8;  // decode chunks requested ahead (1 and 4 measured slower)
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

template <int64_t Rows>
struct RowState {
  float max[Rows];
  float sum[Rows];
  alignas(64) float out[Rows][kDim];
};

// Where rows continue from: their softmax state over earlier keys, as their normalized output
// and log-sum-exp, indexed (i, j, row): (sequence, KV head, query head) for a decode,
// (batch, head, row) for dense attention; strides in elements.
struct Prior {
  const float* out = nullptr;  // [i, j, rows, 64], unit stride along the last
  const float* lse = nullptr;  // [i, j, rows]
  int64_t out_strides[3] = {}, lse_strides[3] = {};
};

// Row (i, j, r) of a prior, if there is one and it saw any key: its output into acc, its state
// into max and sum (a normalized output is the state after its keys with their sum of
// exponentials scaled to 1, the maximum moved to their log-sum-exp). Else nothing changes.
inline void continue_from(const Prior& prior, int64_t i, int64_t j, int64_t r, float& max,
                          float& sum, float* acc) {
  if (prior.out == nullptr) return;
  const float seen =
      prior.lse[i * prior.lse_strides[0] + j * prior.lse_strides[1] + r * prior.lse_strides[2]];
  if (seen == kNegInf) return;  // saw no key
  max = seen;
  sum = 1.0f;
  std::memcpy(acc,
              prior.out + i * prior.out_strides[0] + j * prior.out_strides[1] +
                  r * prior.out_strides[2],
              kDim * sizeof(float));
}

// The prior given to an operator, checked against the shape of its rows (`rows`: the first
// three dimensions of its output).
inline Prior prior_of(const std::optional<at::Tensor>& out, const std::optional<at::Tensor>& lse,
                      at::IntArrayRef rows, const char* shapes) {
  TORCH_CHECK(out.has_value() == lse.has_value(), "prior_out and prior_lse come together");
  Prior prior;
  if (!out.has_value()) return prior;
  TORCH_CHECK(out->dim() == 4 && out->sizes().slice(0, 3) == rows && out->size(3) == kDim &&
                  lse->sizes() == rows,
              shapes);
  TORCH_CHECK(out->scalar_type() == at::kFloat && lse->scalar_type() == at::kFloat &&
                  out->stride(3) == 1,
              "the prior must be float32, unit stride along the head dimension");
  prior.out = out->data_ptr<float>();
  prior.lse = lse->data_ptr<float>();
  for (int d = 0; d < 3; ++d) {
    prior.out_strides[d] = out->stride(d);
    prior.lse_strides[d] = lse->stride(d);
  }
  return prior;
}

struct Shapes {
  int64_t batch, heads, rows, keys, padded;
};

// One task: rows row_start .. + K::kTaskRows of (batch b, head h) through every key block
// they see. q_row(b * heads + h, row) points at a query row's 64 values.
template <class K, typename QRow>
void attend_task(const Shapes& n, int64_t b, int64_t h, int64_t row_start, const QRow& q_row,
                 const typename K::Elem* kpack, const typename K::Elem* vpack,
                 const int64_t* lengths, const Prior& prior, float scale, float* outp,
                 float* lsep) {
  constexpr int64_t kRows = K::kTaskRows;
  alignas(64) typename K::Elem qtile[kRows * kDim] = {};
  RowState<kRows> state;
  const int64_t count = std::min(kRows, n.rows - row_start);
  const int64_t head = b * n.heads + h;
  for (int64_t r = 0; r < count; ++r)
    std::memcpy(qtile + r * kDim, q_row(head, row_start + r), sizeof(qtile) / kRows);
  int64_t seen[kRows] = {};  // keys each row sees; padding rows none
  int64_t longest = 0;
  for (int64_t r = 0; r < kRows; ++r) {
    state.max[r] = kNegInf;
    state.sum[r] = 0.0f;
    std::memset(state.out[r], 0, sizeof(state.out[r]));
    if (r < count) {
      seen[r] = lengths == nullptr ? n.keys
                                   : std::clamp<int64_t>(lengths[b * n.rows + row_start + r],
                                                         0, n.keys);
      continue_from(prior, b, h, row_start + r, state.max[r], state.sum[r], state.out[r]);
    }
    longest = std::max(longest, seen[r]);
  }
  const auto* kbase = kpack + head * n.padded * kDim;
  const auto* vbase = vpack + head * n.padded * kDim;
  for (int64_t block = 0; block < longest; block += kKeyBlock) {
    for (int64_t r0 = 0; r0 < count; r0 += K::kTileRows) {
      int64_t valid[K::kTileRows];
      for (int64_t r = 0; r < K::kTileRows; ++r)
        valid[r] = std::min(kKeyBlock, seen[r0 + r] - block);
      K::tile_block(qtile + r0 * kDim, kbase + block * kDim, vbase + block * kDim, valid,
                    scale, state, r0);
    }
  }
  for (int64_t r = 0; r < count; ++r) {
    const int64_t row = head * n.rows + row_start + r;
    const float sum = state.sum[r];
    const float inverse = sum > 0.0f ? 1.0f / sum : 0.0f;
    for (int64_t d = 0; d < kDim; ++d) outp[row * kDim + d] = state.out[r][d] * inverse;
    lsep[row] = sum > 0.0f ? state.max[r] + std::log(sum) : kNegInf;
  }
}

// What a thread holds around its tasks: the policy's K::Scope where it has one (AMX's tile
// configuration), else nothing.
template <class K>
struct ScopeOf {
  using type = NoScope;
};
template <class K>
  requires requires { typename K::Scope; }
struct ScopeOf<K> {
  using type = typename K::Scope;
};

// Each head's K and V packed by `pack(head, values, out)`: [2 (K, V), heads, padded * 64].
template <class K, typename Pack>
at::Tensor pack_heads(const at::TensorOptions& options, const Shapes& n, const Pack& pack) {
  using Elem = typename K::Elem;
  const int64_t heads = n.batch * n.heads, size = n.padded * kDim;
  at::Tensor packed = at::empty({2, heads, size}, options);
  auto* pp = reinterpret_cast<Elem*>(packed.data_ptr());
  parallel_tasks(2 * heads, [&](int64_t t) {  // K of head t / 2, or its V
    pack(t / 2, t % 2 == 1, pp + ((t % 2) * heads + t / 2) * size);
  });
  return packed;
}

// Every task over K and V packed by pack_heads.
template <class K, typename QRow>
std::tuple<at::Tensor, at::Tensor> attend_packed(const at::TensorOptions& options,
                                                 const Shapes& n, const QRow& q_row,
                                                 const at::Tensor& packed,
                                                 const at::Tensor& counts, const Prior& prior,
                                                 double scale) {
  using Elem = typename K::Elem;
  const int64_t heads = n.batch * n.heads;
  const auto* kpp = reinterpret_cast<const Elem*>(packed.data_ptr());
  const auto* vpp = kpp + heads * n.padded * kDim;
  at::Tensor out = at::empty({n.batch, n.heads, n.rows, kDim}, options.dtype(at::kFloat));
  at::Tensor lse = at::empty({n.batch, n.heads, n.rows}, options.dtype(at::kFloat));
  const int64_t* lp = counts.defined() ? counts.data_ptr<int64_t>() : nullptr;
  float* outp = out.data_ptr<float>();
  float* lsep = lse.data_ptr<float>();
  const int64_t per_head = (n.rows + K::kTaskRows - 1) / K::kTaskRows;
  const auto fscale = static_cast<float>(scale);
  // The last row blocks first: a causal or padded row block costs more the later it lies,
  // and the costliest tasks taken first leave the least for one thread to finish alone.
  parallel_tasks<typename ScopeOf<K>::type>(heads * per_head, [&](int64_t t) {
    const int64_t head = t % heads, block = per_head - 1 - t / heads;
    attend_task<K>(n, head / n.heads, head % n.heads, block * K::kTaskRows, q_row, kpp, vpp, lp,
                   prior, fscale, outp, lsep);
  });
  return {out, lse};
}

// Pack one head's keys or values (key_at(n) points at key n's 64 values).
template <class K, typename KeyAt>
void pack_head(const KeyAt& key_at, bool values, int64_t keys, int64_t padded,
               typename K::Elem* out) {
  values ? K::pack_values(key_at, keys, padded, out) : K::pack_keys(key_at, keys, padded, out);
}

//   q [batch, heads, rows, 64], k / v [batch, heads, keys, 64] (any strides; read in place
//   where the last dimension's is 1); lengths: none (every row sees every key) or
//   [batch, rows] integers (row r sees keys 0 .. lengths[b, r] - 1);
//   optionally prior_out [batch, heads, rows, 64] and prior_lse [batch, heads, rows] f32, the
//   rows' attention over other keys (a shared prefix's common blocks), which the result then
//   includes: one softmax over both, no merge afterwards
//   → out [batch, heads, rows, 64] f32, lse [batch, heads, rows] f32 (natural log of the sum
//   of exp(scale * q·k); a row that sees no key gets 0 and -inf).
template <class K>
std::tuple<at::Tensor, at::Tensor> dense_attention(const at::Tensor& q, const at::Tensor& k,
                                                   const at::Tensor& v,
                                                   const std::optional<at::Tensor>& lengths,
                                                   double scale,
                                                   const std::optional<at::Tensor>& prior_out,
                                                   const std::optional<at::Tensor>& prior_lse) {
  using Elem = typename K::Elem;
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4,
              "q, k, v must be [batch, heads, n, 64]");
  TORCH_CHECK(q.scalar_type() == K::kType && k.scalar_type() == K::kType &&
                  v.scalar_type() == K::kType,
              "q, k, v must be ", K::kTypeName);
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
  // Read where they lie (a transposed view included), unless a row is not contiguous.
  const auto rows_of = [](const at::Tensor& t) { return t.stride(3) == 1 ? t : t.contiguous(); };
  const at::Tensor qc = rows_of(q), kc = rows_of(k), vc = rows_of(v);
  // Row `row` of head `head` (= b * heads + h) of t.
  const auto row_at = [&](const at::Tensor& t, int64_t head, int64_t row) {
    return reinterpret_cast<const Elem*>(t.data_ptr()) + (head / n.heads) * t.stride(0) +
           (head % n.heads) * t.stride(1) + row * t.stride(2);
  };
  const auto pack = [&](int64_t head, bool values, Elem* out) {
    const at::Tensor& source = values ? vc : kc;
    pack_head<K>([&](int64_t key) { return row_at(source, head, key); }, values, keys, n.padded,
                 out);
  };
  const auto q_row = [&](int64_t head, int64_t row) { return row_at(qc, head, row); };
  const Prior prior = prior_of(prior_out, prior_lse, {n.batch, n.heads, n.rows},
                               "prior_out must be [batch, heads, rows, 64] and prior_lse "
                               "[batch, heads, rows]");
  return attend_packed<K>(q.options(), n, q_row, pack_heads<K>(q.options(), n, pack), counts,
                          prior, scale);
}

// What the operators reading the paged cache take: two contiguous caches [blocks,
// block_size, kv_heads, 64] of one shape and of K's type.
template <class K>
void check_caches(const at::Tensor& k_cache, const at::Tensor& v_cache) {
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.dim() == 4,
              "the caches must be [blocks, block_size, kv_heads, 64]");
  TORCH_CHECK(k_cache.scalar_type() == K::kType && v_cache.scalar_type() == K::kType,
              "the caches must be ", K::kTypeName);
  TORCH_CHECK(k_cache.size(3) == kDim, "head dimension must be 64");
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes() && k_cache.is_contiguous() &&
                  v_cache.is_contiguous(),
              "the caches must be contiguous and of one shape");
}

// ... and a q of `q_dims` dimensions (shaped as `q_shape` says), of K's type too.
template <class K>
void check_paged(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                 int64_t q_dims, const char* q_shape) {
  TORCH_CHECK(q.dim() == q_dims, q_shape, " and the caches [blocks, block_size, kv_heads, 64]");
  TORCH_CHECK(q.scalar_type() == K::kType, "q and the caches must be ", K::kTypeName);
  TORCH_CHECK(q.size(-1) == kDim, "head dimension must be 64");
  check_caches<K>(k_cache, v_cache);
}

// The common blocks' keys: as many as the blocks hold, padded to whole softmax blocks.
inline Shapes common_shapes(int64_t kv_heads, int64_t rows, int64_t num_blocks,
                            int64_t block_size) {
  const int64_t keys = num_blocks * block_size;
  return {1, kv_heads, rows, keys, (keys + kKeyBlock - 1) / kKeyBlock * kKeyBlock};
}

// K and V of whole blocks of the paged cache, packed for prefix_attention: a shared prefix's
// common blocks, which every decode step of the sequences sharing them reads again (the
// caller may keep this across steps while no step writes into those blocks).
//
//   k_cache / v_cache [blocks, block_size, kv_heads, 64]; block_ids [b] integers
//   → [2 (K, V), kv_heads, padded keys * 64] in the kernel's layout.
template <class K>
at::Tensor pack_common(const at::Tensor& k_cache, const at::Tensor& v_cache,
                       const at::Tensor& block_ids) {
  using Elem = typename K::Elem;
  check_caches<K>(k_cache, v_cache);
  TORCH_CHECK(block_ids.dim() == 1 && block_ids.numel() > 0, "block_ids must be [n], n >= 1");
  const at::Tensor ids = block_ids.to(at::kLong).contiguous();
  const int64_t* ip = ids.data_ptr<int64_t>();
  for (int64_t b = 0; b < ids.numel(); ++b)
    TORCH_CHECK(ip[b] >= 0 && ip[b] < k_cache.size(0), "a block id is outside the cache");
  const int64_t kv_heads = k_cache.size(2), block_size = k_cache.size(1);
  const Shapes n = common_shapes(kv_heads, 0, ids.numel(), block_size);
  const auto* kp = reinterpret_cast<const Elem*>(k_cache.data_ptr());
  const auto* vp = reinterpret_cast<const Elem*>(v_cache.data_ptr());
  return pack_heads<K>(k_cache.options(), n, [&](int64_t head, bool values, Elem* out) {
    const Elem* base = values ? vp : kp;
    const auto at = [&](int64_t key) {
      return base + ((ip[key / block_size] * block_size + key % block_size) * kv_heads + head) *
                        kDim;
    };
    pack_head<K>(at, values, n.keys, n.padded, out);
  });
}

// Rows of each KV head against every key of whole blocks of the paged cache, read in place
// (or as pack_common packed them, if `packed` is given): a shared prefix's common blocks,
// seen by every query of the sequences that share them.
//
//   q [n, kv_heads, m, 64], any strides but the last (head h's rows are q[:, h] in order: a
//   decode step's query as it is, [sequences, kv_heads, query heads per KV head, 64]);
//   k_cache / v_cache [blocks, block_size, kv_heads, 64]; block_ids [b] integers;
//   packed: pack_common(k_cache, v_cache, block_ids), or none
//   → out [kv_heads, n * m, 64] f32, lse [kv_heads, n * m] f32.
template <class K>
std::tuple<at::Tensor, at::Tensor> prefix_attention(const at::Tensor& q, const at::Tensor& k_cache,
                                                    const at::Tensor& v_cache,
                                                    const at::Tensor& block_ids, double scale,
                                                    const std::optional<at::Tensor>& packed) {
  using Elem = typename K::Elem;
  check_paged<K>(q, k_cache, v_cache, 4, "q must be [n, kv_heads, m, 64]");
  TORCH_CHECK(q.stride(3) == 1, "q must have unit stride along its last dimension");
  const int64_t kv_heads = k_cache.size(2), block_size = k_cache.size(1);
  TORCH_CHECK(q.size(1) == kv_heads, "q must have one row set per KV head");
  TORCH_CHECK(block_ids.dim() == 1 && block_ids.numel() > 0, "block_ids must be [n], n >= 1");
  const int64_t per_outer = q.size(2);
  const Shapes n = common_shapes(kv_heads, q.size(0) * per_outer, block_ids.numel(), block_size);
  const at::Tensor keys = packed ? *packed : pack_common<K>(k_cache, v_cache, block_ids);
  TORCH_CHECK(keys.scalar_type() == K::kType && keys.is_contiguous() &&
                  keys.sizes() == at::IntArrayRef({2, kv_heads, n.padded * kDim}),
              "packed must be pack_common's result for these caches and block_ids");
  const auto* qp = reinterpret_cast<const Elem*>(q.data_ptr());
  const int64_t outer_stride = q.stride(0), head_stride = q.stride(1), row_stride = q.stride(2);
  const auto q_row = [&](int64_t head, int64_t row) {
    return qp + (row / per_outer) * outer_stride + head * head_stride +
           (row % per_outer) * row_stride;
  };
  auto [out, lse] = attend_packed<K>(q.options(), n, q_row, keys, at::Tensor(), Prior(), scale);
  return {out.squeeze(0), lse.squeeze(0)};
}

// ---- Paged decode ------------------------------------------------------------------------
// One query token per sequence against its keys where they lie in the paged cache: no gather
// into a workspace, no repacking (each key serves only the G query heads of its KV head, too
// few to pay for either). Softmax runs online over chunks of up to 16 keys of one block.
//
//   q [seqs, kv_heads * G, 64]; k_cache / v_cache [blocks, block_size, kv_heads, 64];
//   block_table [seqs, >= blocks used] and lengths [seqs] integers (sequence s reads keys
//   0 .. lengths[s] - 1 of the blocks its table lists, in order); optionally prior_out
//   [seqs, kv_heads, G, 64] and prior_lse [seqs, kv_heads, G] f32, the rows' attention over
//   earlier keys (`prefix_attention`'s over common blocks), which the result then includes
//   → out [seqs, kv_heads * G, 64] f32, lse [seqs, kv_heads * G] f32.

struct PagedShapes {
  int64_t kv_heads, block_size, table_stride;
};

// Online-softmax state of one KV head's G query rows.
template <int G>
struct HeadState {
  float max[G], sum[G];
  alignas(64) float acc[G][kDim];
};

// Sequence s, KV head h: its G query rows through keys `begin` .. `end` - 1, chunk by
// chunk, with the lines of the next kChunksAhead chunks requested before each is worked on,
// continuing from `prior` if it has one (pass an empty Prior for all but a sequence's first
// range). q, out and lse point at the head's first query row.
template <class K, int G>
void decode_task(const PagedShapes& n, const typename K::Elem* q, const typename K::Elem* kc,
                 const typename K::Elem* vc, const int64_t* table, int64_t begin,
                 int64_t end, int64_t s, int64_t h, const Prior& prior, float scale,
                 float* out, float* lse) {
  HeadState<G> state;
  std::memset(state.acc, 0, sizeof(state.acc));
  for (int r = 0; r < G; ++r) {
    state.max[r] = kNegInf;
    state.sum[r] = 0.0f;
    continue_from(prior, s, h, r, state.max[r], state.sum[r], state.acc[r]);
  }
  const int64_t stride = n.kv_heads * kDim;
  const auto chunk_at = [&](int64_t start, int64_t& first) {  // its first element; its length
    const int64_t offset = start % n.block_size;
    first = (table[start / n.block_size] * n.block_size + offset) * stride + h * kDim;
    return std::min({int64_t{16}, n.block_size - offset, end - start});
  };
  // Chunks requested ahead of the one being worked on: a sequence's blocks lie anywhere, so
  // the hardware prefetcher cannot follow them, and one chunk's lines do not cover DRAM's
  // latency.
  constexpr int64_t kLine = 64 / sizeof(typename K::Elem);  // elements per cache line
  int64_t ahead = begin, requested = 0;
  int64_t first = 0;
  for (int64_t start = begin, count = 0; start < end; start += count) {
    for (; ahead < end && requested <= kChunksAhead; ++requested) {
      int64_t at = 0;
      const int64_t length = chunk_at(ahead, at);
      for (int64_t t = 0; t < length; ++t)
        for (int64_t line = 0; line < kDim; line += kLine) {
          __builtin_prefetch(kc + at + t * stride + line, 0, 3);
          __builtin_prefetch(vc + at + t * stride + line, 0, 3);
        }
      ahead += length;
    }
    count = chunk_at(start, first);
    --requested;
    K::template decode_chunk<G>(q, kc, vc, first, count, stride, scale, state);
  }
  for (int r = 0; r < G; ++r) {
    const float inverse = state.sum[r] > 0.0f ? 1.0f / state.sum[r] : 0.0f;
    for (int64_t d = 0; d < kDim; ++d) out[r * kDim + d] = state.acc[r][d] * inverse;
    lse[r] = state.sum[r] > 0.0f ? state.max[r] + std::log(state.sum[r]) : kNegInf;
  }
}

// Few (sequence, KV head) tasks with long keys split each one's keys into ranges, run as
// tasks of their own and merged after: one user's decode has 3 KV heads, which would keep one
// of two threads waiting on the third. How many ranges depends on the shapes alone, never on
// the thread count (which adapts to the host's load): the same bits on any count.
constexpr int64_t kSplitBelow = 16;     // tasks under which keys are split
constexpr int64_t kSplitMinKeys = 256;  // keys a range holds at least

inline int64_t key_ranges(int64_t tasks, int64_t longest) {
  if (tasks >= kSplitBelow) return 1;
  return std::clamp<int64_t>(
      std::min((kSplitBelow + tasks - 1) / tasks, longest / kSplitMinKeys), 1, kSplitBelow);
}

template <class K, int G>
void decode_all(const PagedShapes& n, int64_t seqs, const typename K::Elem* q,
                const typename K::Elem* kc, const typename K::Elem* vc, const int64_t* table,
                const int64_t* lengths, const Prior& prior, float scale, float* out,
                float* lse) {
  const int64_t tasks = seqs * n.kv_heads;
  const int64_t longest = seqs > 0 ? *std::max_element(lengths, lengths + seqs) : 0;
  const int64_t ranges = key_ranges(tasks, longest);
  if (ranges == 1) {
    parallel_tasks(tasks, [&](int64_t t) {
      const int64_t s = t / n.kv_heads, h = t % n.kv_heads;
      const int64_t row = (s * n.kv_heads + h) * G;  // the first of its query heads
      decode_task<K, G>(n, q + row * kDim, kc, vc, table + s * n.table_stride, 0, lengths[s], s,
                        h, prior, scale, out + row * kDim, lse + row);
    });
    return;
  }
  // Each range's rows into scratch ([range][sequence, KV head][G]), then merged as softmax
  // partials are: out = sum of exp(lse_i - lse) * out_i, lse = log of the sum of exp(lse_i).
  std::vector<float> part_out(ranges * tasks * G * kDim), part_lse(ranges * tasks * G);
  parallel_tasks(ranges * tasks, [&](int64_t t) {
    const int64_t range = t / tasks, task = t % tasks;
    const int64_t s = task / n.kv_heads, h = task % n.kv_heads;
    const int64_t row = (s * n.kv_heads + h) * G, part = range * tasks * G + task * G;
    const int64_t chunks = (lengths[s] + 15) / 16;  // ranges start on 16-key boundaries
    const int64_t begin = std::min(lengths[s], range * chunks / ranges * 16);
    const int64_t end = std::min(lengths[s], (range + 1) * chunks / ranges * 16);
    decode_task<K, G>(n, q + row * kDim, kc, vc, table + s * n.table_stride, begin, end, s, h,
                      range == 0 ? prior : Prior(), scale, part_out.data() + part * kDim,
                      part_lse.data() + part);
  });
  for (int64_t row = 0; row < tasks * G; ++row) {
    float top = kNegInf;
    for (int64_t r = 0; r < ranges; ++r) top = std::max(top, part_lse[r * tasks * G + row]);
    float* o = out + row * kDim;
    std::fill(o, o + kDim, 0.0f);
    if (top == kNegInf) {  // no key, no prior: as an unsplit task leaves it
      lse[row] = kNegInf;
      continue;
    }
    float total = 0.0f;
    for (int64_t r = 0; r < ranges; ++r) {
      const float weight = std::exp(part_lse[r * tasks * G + row] - top);
      const float* p = part_out.data() + (r * tasks * G + row) * kDim;
      for (int64_t d = 0; d < kDim; ++d) o[d] += weight * p[d];
      total += weight;
    }
    for (int64_t d = 0; d < kDim; ++d) o[d] /= total;
    lse[row] = top + std::log(total);
  }
}

template <class K>
std::tuple<at::Tensor, at::Tensor> paged_decode(const at::Tensor& q, const at::Tensor& k_cache,
                                                const at::Tensor& v_cache,
                                                const at::Tensor& block_table,
                                                const at::Tensor& lengths, double scale,
                                                const std::optional<at::Tensor>& prior_out,
                                                const std::optional<at::Tensor>& prior_lse) {
  using Elem = typename K::Elem;
  check_paged<K>(q, k_cache, v_cache, 3, "q must be [seqs, heads, 64]");
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
  const Prior prior = prior_of(prior_out, prior_lse, {seqs, kv_heads, group},
                               "prior_out must be [seqs, kv_heads, group, 64] and prior_lse "
                               "[seqs, kv_heads, group]");
  const at::Tensor qc = q.contiguous();
  at::Tensor out = at::empty(q.sizes(), q.options().dtype(at::kFloat));
  at::Tensor lse = at::empty({seqs, q.size(1)}, q.options().dtype(at::kFloat));
  const PagedShapes n{kv_heads, block_size, table.size(1)};
  const auto* qp = reinterpret_cast<const Elem*>(qc.data_ptr());
  const auto* kp = reinterpret_cast<const Elem*>(k_cache.data_ptr());
  const auto* vp = reinterpret_cast<const Elem*>(v_cache.data_ptr());
  const auto fscale = static_cast<float>(scale);
  float* outp = out.data_ptr<float>();
  float* lsep = lse.data_ptr<float>();
  switch (group) {
#define BLOCKSERVE_GROUP(G) \
  case G:                   \
    decode_all<K, G>(n, seqs, qp, kp, vp, tp, lp, prior, fscale, outp, lsep); \
    break;
    BLOCKSERVE_GROUP(1) BLOCKSERVE_GROUP(2) BLOCKSERVE_GROUP(3) BLOCKSERVE_GROUP(4)
    BLOCKSERVE_GROUP(5) BLOCKSERVE_GROUP(6) BLOCKSERVE_GROUP(7) BLOCKSERVE_GROUP(8)
#undef BLOCKSERVE_GROUP
  }
  return {out, lse};
}

// A decode step's attention in one call: each sequence's query rows over the common blocks
// (`prefix_attention` by policy P, over `packed` if given; none without common_ids), then
// over its own blocks continuing from there (`paged_decode` by policy K), in q's dtype.
//
//   q [seqs, kv_heads * G, 64] (rows of any stride, unit along the last); own_tables,
//   own_lengths, scale as paged_decode's; common_ids [b] and packed as prefix_attention's
//   → out [seqs, kv_heads * G, 64] in q's dtype.
template <class P, class K>
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_cache,
                            const at::Tensor& v_cache, const at::Tensor& own_tables,
                            const at::Tensor& own_lengths, double scale,
                            const std::optional<at::Tensor>& common_ids,
                            const std::optional<at::Tensor>& packed) {
  check_paged<K>(q, k_cache, v_cache, 3, "q must be [seqs, heads, 64]");
  const int64_t seqs = q.size(0), kv_heads = k_cache.size(2);
  TORCH_CHECK(q.size(1) % kv_heads == 0 && q.size(1) / kv_heads <= kMaxGroup,
              "query heads must be 1 to 8 per KV head");
  TORCH_CHECK(!packed || common_ids, "packed comes with common_ids");
  std::optional<at::Tensor> prior_out, prior_lse;
  if (common_ids) {  // [kv_heads, seqs * G, ...] as [seqs, kv_heads, G, ...] views
    const int64_t group = q.size(1) / kv_heads;
    auto [out, lse] = prefix_attention<P>(q.unflatten(1, {kv_heads, group}), k_cache, v_cache,
                                          *common_ids, scale, packed);
    prior_out = out.view({kv_heads, seqs, group, kDim}).transpose(0, 1);
    prior_lse = lse.view({kv_heads, seqs, group}).transpose(0, 1);
  }
  auto [out, lse] = paged_decode<K>(q, k_cache, v_cache, own_tables, own_lengths, scale,
                                    prior_out, prior_lse);
  return out.to(q.scalar_type());
}

// The operators' schemas, and their implementations by kernel policy K.
inline void define_attention(torch::Library& m) {
  m.def(
      "dense_attention(Tensor q, Tensor k, Tensor v, Tensor? lengths, float scale,"
      " Tensor? prior_out=None, Tensor? prior_lse=None) -> (Tensor, Tensor)");
  m.def(
      "prefix_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_ids, float scale,"
      " Tensor? packed=None) -> (Tensor, Tensor)");
  m.def("pack_common(Tensor k_cache, Tensor v_cache, Tensor block_ids) -> Tensor");
  m.def(
      "paged_decode(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, Tensor lengths,"
      " float scale, Tensor? prior_out=None, Tensor? prior_lse=None) -> (Tensor, Tensor)");
  m.def(
      "decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor own_tables,"
      " Tensor own_lengths, float scale, Tensor? common_ids=None, Tensor? packed=None) -> Tensor");
}

template <class K>
void implement_attention(torch::Library& m) {
  m.impl("dense_attention", &dense_attention<K>);
  m.impl("prefix_attention", &prefix_attention<K>);
  m.impl("pack_common", &pack_common<K>);
  m.impl("paged_decode", &paged_decode<K>);
  m.impl("decode_attention", &decode_attention<K, K>);
}

}  // namespace
}  // namespace blockserve_cpu
