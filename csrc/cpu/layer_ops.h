// What our fused layer operators (layer_ops_bf16.cpp, layer_ops_f32.cpp) share whatever the
// element type: the argument checks, the split of rows across threads, the op schemas. Each
// library supplies the arithmetic of one row as a layer policy L:
//
//   using Elem;  static constexpr LayerChecks kCheck;  (its type, for the checks)
//   norm_row(x, weight, hidden, eps, out)       out = RMSNorm of one row
//   add_row(residual, update, hidden)           residual += update, in place
//   rotate_token(x, cos, sin, heads)            one token's `heads` 64-wide heads, in place
//   silu_mul_row(gate_up, width, out)           out = silu(gate) * up, up at gate_up + width
//   argmax_row(x, n)                            the index of x's largest of n values: the
//                                               first of equal ones, the first NaN if any
//
//   rms_norm(x [rows, hidden], weight [hidden]) → weight * (x * rsqrt(mean(x²) + eps))
//   add_rms_norm(residual [rows, hidden] (in place), update, weight): residual += update, then
//     rms_norm of the new residual
//   rotary_(qkv [tokens, (q_heads + 2 kv_heads) * 64] (in place), cos, sin [tokens, 32]):
//     each q and k head's halves (x1, x2) → (x1 cos − x2 sin, x2 cos + x1 sin)
//   silu_and_mul(gate_up [rows, 2 * n]) → silu(gate) * up [rows, n]
//   argmax_rows(x [rows, n]) → [rows] int64: torch.max(x, -1).indices (greedy sampling, read
//     from the LM head's output in its own dtype: widening bf16 to float32 is exact)
//   write_kv_(kv_cache [2, blocks, block_size, kv_heads, dim] (in place), slots [tokens],
//     key, value [tokens, kv_heads, dim]): token t's K and V into slot slots[t] (one call a
//     layer for what two index_copy_ did; every slot is checked before anything is written)
//
// Rows have unit stride along their last dimension, a multiple of 16 (a whole number of
// vectors in either library), except argmax_rows' (any n ≥ 1). Internal linkage, as in
// attention.h.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "tasks.h"

namespace blockserve_cpu {
namespace {

constexpr int64_t kRowGrain = 1 << 15;  // elements a thread should have before work is split
constexpr int64_t kRotaryDim = 64, kRotaryHalf = kRotaryDim / 2;

// Rows of `width` elements, split across threads in runs of at least kRowGrain elements
// (tasks.h: a thread takes the next run when it finishes one).
template <typename F>
void for_rows(int64_t rows, int64_t width, const F& body) {
  const int64_t per_run = std::max<int64_t>(1, kRowGrain / width);
  parallel_tasks((rows + per_run - 1) / per_run, [&](int64_t run) {
    const int64_t end = std::min(rows, (run + 1) * per_run);
    for (int64_t row = run * per_run; row < end; ++row) body(row);
  });
}

// The checks, for tensors of `type` (named `type_name` in errors).
struct LayerChecks {
  at::ScalarType type;
  const char* type_name;

  void rows(const at::Tensor& x, const char* name) const {
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == type && x.stride(1) == 1, name, " must be a ",
                type_name, " [rows, n] tensor with unit stride along n");
    TORCH_CHECK(x.size(1) % 16 == 0, name, "'s last dimension must be a multiple of 16");
  }

  void weight(const at::Tensor& x, const at::Tensor& weight) const {
    TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.is_contiguous() &&
                    weight.scalar_type() == type,
                "weight must be a contiguous ", type_name, " [hidden]");
  }

  void residual(const at::Tensor& residual, const at::Tensor& update,
                const at::Tensor& weight) const {
    rows(residual, "residual");
    rows(update, "update");
    this->weight(residual, weight);
    TORCH_CHECK(update.sizes() == residual.sizes(), "update must have the residual's shape");
  }

  void rotary(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
              int64_t q_heads, int64_t kv_heads) const {
    rows(qkv, "qkv");
    TORCH_CHECK(q_heads > 0 && kv_heads > 0 &&
                    qkv.size(1) == (q_heads + 2 * kv_heads) * kRotaryDim,
                "qkv must be [tokens, (q_heads + 2 kv_heads) * 64]");
    for (const at::Tensor* table : {&cos, &sin})
      TORCH_CHECK(table->dim() == 2 && table->size(0) == qkv.size(0) &&
                      table->size(1) == kRotaryHalf && table->is_contiguous() &&
                      table->scalar_type() == type,
                  "cos and sin must be contiguous ", type_name, " [tokens, 32]");
  }

  void gate_up(const at::Tensor& gate_up) const {
    rows(gate_up, "gate_up");
    TORCH_CHECK(gate_up.size(1) % 32 == 0, "gate_up's halves must be multiples of 16");
  }
};

template <class L>
typename L::Elem* elements(const at::Tensor& t) {
  return reinterpret_cast<typename L::Elem*>(t.data_ptr());
}

template <class L>
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  L::kCheck.rows(x, "x");
  L::kCheck.weight(x, weight);
  at::Tensor out = at::empty(x.sizes(), x.options());
  const int64_t hidden = x.size(1), stride = x.stride(0);
  const auto *xp = elements<L>(x), *wp = elements<L>(weight);
  auto* op = elements<L>(out);
  const auto feps = static_cast<float>(eps);
  for_rows(x.size(0), hidden, [&](int64_t row) {
    L::norm_row(xp + row * stride, wp, hidden, feps, op + row * hidden);
  });
  return out;
}

template <class L>
at::Tensor add_rms_norm(at::Tensor& residual, const at::Tensor& update, const at::Tensor& weight,
                        double eps) {
  L::kCheck.residual(residual, update, weight);
  at::Tensor out = at::empty(residual.sizes(), residual.options());
  const int64_t hidden = residual.size(1);
  const int64_t rstride = residual.stride(0), ustride = update.stride(0);
  auto* rp = elements<L>(residual);
  const auto *up = elements<L>(update), *wp = elements<L>(weight);
  auto* op = elements<L>(out);
  const auto feps = static_cast<float>(eps);
  for_rows(residual.size(0), hidden, [&](int64_t row) {
    L::add_row(rp + row * rstride, up + row * ustride, hidden);
    L::norm_row(rp + row * rstride, wp, hidden, feps, op + row * hidden);
  });
  return out;
}

template <class L>
void rotary_(at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t q_heads,
             int64_t kv_heads) {
  L::kCheck.rotary(qkv, cos, sin, q_heads, kv_heads);
  const int64_t rotated = q_heads + kv_heads, stride = qkv.stride(0);
  auto* xp = elements<L>(qkv);
  const auto *cp = elements<L>(cos), *sp = elements<L>(sin);
  for_rows(qkv.size(0), rotated * kRotaryDim, [&](int64_t token) {
    L::rotate_token(xp + token * stride, cp + token * kRotaryHalf, sp + token * kRotaryHalf,
                    rotated);
  });
}

template <class L>
at::Tensor silu_and_mul(const at::Tensor& gate_up) {
  L::kCheck.gate_up(gate_up);
  const int64_t width = gate_up.size(1) / 2, stride = gate_up.stride(0);
  at::Tensor out = at::empty({gate_up.size(0), width}, gate_up.options());
  const auto* gp = elements<L>(gate_up);
  auto* op = elements<L>(out);
  for_rows(gate_up.size(0), width, [&](int64_t row) {
    L::silu_mul_row(gp + row * stride, width, op + row * width);
  });
  return out;
}

template <class L>
at::Tensor argmax_rows(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == L::kCheck.type && x.stride(1) == 1 &&
                  x.size(1) > 0,
              "x must be a ", L::kCheck.type_name, " [rows, n] tensor, n >= 1, with unit "
              "stride along n");
  const int64_t n = x.size(1), stride = x.stride(0);
  at::Tensor out = at::empty({x.size(0)}, x.options().dtype(at::kLong));
  const auto* xp = elements<L>(x);
  auto* op = out.data_ptr<int64_t>();
  for_rows(x.size(0), n, [&](int64_t row) { op[row] = L::argmax_row(xp + row * stride, n); });
  return out;
}

template <class L>
void write_kv_(at::Tensor& kv_cache, const at::Tensor& slots, const at::Tensor& key,
               const at::Tensor& value) {
  const auto type = L::kCheck.type;
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.is_contiguous() &&
                  kv_cache.scalar_type() == type,
              "kv_cache must be a contiguous ", L::kCheck.type_name,
              " [2, blocks, block_size, kv_heads, dim]");
  const int64_t heads = kv_cache.size(3), dim = kv_cache.size(4);
  const int64_t num_slots = kv_cache.size(1) * kv_cache.size(2), width = heads * dim;
  for (const at::Tensor* t : {&key, &value})
    TORCH_CHECK(t->dim() == 3 && t->size(1) == heads && t->size(2) == dim &&
                    t->scalar_type() == type && t->stride(2) == 1 && t->stride(1) == dim,
                "key and value must be ", L::kCheck.type_name,
                " [tokens, kv_heads, dim], each token's heads contiguous");
  TORCH_CHECK(key.size(0) == value.size(0) && slots.dim() == 1 &&
                  slots.scalar_type() == at::kLong && slots.size(0) == key.size(0),
              "slots must be int64 [tokens], as many as key and value have");
  const at::Tensor slot_list = slots.contiguous();
  const int64_t* sp = slot_list.data_ptr<int64_t>();
  const int64_t tokens = key.size(0);
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(sp[t] >= 0 && sp[t] < num_slots, "slot ", sp[t], " is outside the cache");
  auto* kp = elements<L>(kv_cache);
  auto* vp = kp + num_slots * width;
  const auto *kin = elements<L>(key), *vin = elements<L>(value);
  const int64_t bytes = width * static_cast<int64_t>(sizeof(typename L::Elem));
  for_rows(tokens, 2 * width, [&](int64_t t) {
    std::memcpy(kp + sp[t] * width, kin + t * key.stride(0), bytes);
    std::memcpy(vp + sp[t] * width, vin + t * value.stride(0), bytes);
  });
}

// How a policy's argmax_row ends. Its vectors went over x[0, whole), each lane keeping its
// first strict maximum (lane_best[l] at index lane_at[l]; a lane that saw none, -inf at 0)
// and flagging any NaN: then the first NaN, as torch; else the lowest index among the lanes
// holding the largest value, continued over the tail x[whole, n) one value at a time.
template <int64_t Lanes, typename Value>
int64_t finish_argmax(const float* lane_best, const int32_t* lane_at, bool saw_nan,
                      int64_t whole, int64_t n, const Value& value) {
  if (saw_nan) {
    for (int64_t i = 0; i < whole; ++i)
      if (std::isnan(value(i))) return i;
  }
  int64_t result = -1;
  float top = 0.0f;
  for (int64_t l = 0; l < Lanes && whole > 0; ++l)
    if (result < 0 || lane_best[l] > top || (lane_best[l] == top && lane_at[l] < result)) {
      top = lane_best[l];
      result = lane_at[l];
    }
  for (int64_t i = whole; i < n; ++i) {
    const float v = value(i);
    if (std::isnan(v)) return i;
    if (result < 0 || v > top) {
      top = v;
      result = i;
    }
  }
  return result;
}

template <class L>
void implement_layer(torch::Library& m) {
  m.impl("rms_norm", &rms_norm<L>);
  m.impl("add_rms_norm", &add_rms_norm<L>);
  m.impl("rotary_", &rotary_<L>);
  m.impl("silu_and_mul", &silu_and_mul<L>);
  m.impl("argmax_rows", &argmax_rows<L>);
  m.impl("write_kv_", &write_kv_<L>);
}

inline void define_layer(torch::Library& m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor(a!) residual, Tensor update, Tensor weight, float eps) -> Tensor");
  m.def("rotary_(Tensor(a!) qkv, Tensor cos, Tensor sin, int q_heads, int kv_heads) -> ()");
  m.def("silu_and_mul(Tensor gate_up) -> Tensor");
  m.def("argmax_rows(Tensor x) -> Tensor");
  m.def("write_kv_(Tensor(a!) kv_cache, Tensor slots, Tensor key, Tensor value) -> ()");
}

}  // namespace
}  // namespace blockserve_cpu
