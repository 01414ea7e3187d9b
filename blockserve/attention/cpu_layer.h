// What our fused layer operators (cpu_layer_bf16.cpp, cpu_layer_f32.cpp) share whatever the
// element type: the split of rows across threads, the argument checks, the op schemas.
//
//   rms_norm(x [rows, hidden], weight [hidden]) → weight * (x * rsqrt(mean(x²) + eps))
//   add_rms_norm(residual [rows, hidden] (in place), update, weight): residual += update, then
//     rms_norm of the new residual
//   rotary_(qkv [tokens, (q_heads + 2 kv_heads) * 64] (in place), cos, sin [tokens, 32]):
//     each q and k head's halves (x1, x2) → (x1 cos − x2 sin, x2 cos + x1 sin)
//   silu_and_mul(gate_up [rows, 2 * n]) → silu(gate) * up [rows, n]
//
// Rows have unit stride along their last dimension, a multiple of 16 (a whole number of
// vectors in either library). Internal linkage, as in cpu_attention.h.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

namespace blockserve_cpu {
namespace {

constexpr int64_t kRowGrain = 1 << 15;  // elements a thread should have before work is split
constexpr int64_t kRotaryDim = 64, kRotaryHalf = kRotaryDim / 2;

// Rows of `width` elements, split across threads in runs of at least kRowGrain elements.
template <typename F>
void for_rows(int64_t rows, int64_t width, const F& body) {
  at::parallel_for(0, rows, std::max<int64_t>(1, kRowGrain / width),
                   [&](int64_t begin, int64_t end) {
                     for (int64_t row = begin; row < end; ++row) body(row);
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

inline void define_layer(torch::Library& m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor(a!) residual, Tensor update, Tensor weight, float eps) -> Tensor");
  m.def("rotary_(Tensor(a!) qkv, Tensor cos, Tensor sin, int q_heads, int kv_heads) -> ()");
  m.def("silu_and_mul(Tensor gate_up) -> Tensor");
}

}  // namespace
}  // namespace blockserve_cpu
