// The elementwise math of a Llama layer, fused, for bfloat16 on x86 CPUs with AVX512-BF16:
// RMSNorm (alone, or after the residual add), the rotary embedding of q and k in place, and
// SiLU(gate) * up. An eager forward spends ~20 torch operators a layer on these, each a pass
// over memory and a dispatch; here each is one pass.
//
// The operators' shapes are in cpu_layer.h. Every result equals torch's bf16 composition
// (model/llama.py) to the bit where that rounds the same intermediates: each value is rounded
// to bf16 wherever torch's operator would write a bf16 tensor (RMSNorm's normalized x before
// the weight, each rotary product), and computed in float32 in between. Two places may differ
// by one bf16 step: RMSNorm's mean of squares is summed in another order, and SiLU's exp is
// our own.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>

#include "cpu_bf16_common.h"
#include "cpu_layer.h"

namespace {

using namespace blockserve_cpu;

constexpr int64_t kLanes = 16;
constexpr LayerChecks kCheck{at::kBFloat16, "bfloat16"};

const uint16_t* bf16_data(const at::Tensor& t) {
  return reinterpret_cast<const uint16_t*>(t.data_ptr());
}
uint16_t* bf16_data_mut(at::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr()); }

// One row: out = weight * bf16(x * rsqrt(mean(x²) + eps)).
inline void norm_row(const uint16_t* x, const uint16_t* weight, int64_t hidden, float eps,
                     uint16_t* out) {
  __m512 squares = _mm512_setzero_ps();
  for (int64_t c = 0; c < hidden; c += kLanes) {
    const __m512 v = widen_bf16(x + c);
    squares = _mm512_fmadd_ps(v, v, squares);
  }
  const float mean = _mm512_reduce_add_ps(squares) / static_cast<float>(hidden);
  const __m512 inverse = _mm512_set1_ps(1.0f / std::sqrt(mean + eps));
  for (int64_t c = 0; c < hidden; c += kLanes) {
    const __m512 normed = round_bf16(_mm512_mul_ps(widen_bf16(x + c), inverse));
    store_bf16(out + c, _mm512_mul_ps(widen_bf16(weight + c), normed));
  }
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  kCheck.rows(x, "x");
  kCheck.weight(x, weight);
  at::Tensor out = at::empty(x.sizes(), x.options());
  const int64_t hidden = x.size(1), stride = x.stride(0);
  const uint16_t *xp = bf16_data(x), *wp = bf16_data(weight);
  uint16_t* op = bf16_data_mut(out);
  const auto feps = static_cast<float>(eps);
  for_rows(x.size(0), hidden, [&](int64_t row) {
    norm_row(xp + row * stride, wp, hidden, feps, op + row * hidden);
  });
  return out;
}

at::Tensor add_rms_norm(at::Tensor& residual, const at::Tensor& update, const at::Tensor& weight,
                        double eps) {
  kCheck.residual(residual, update, weight);
  at::Tensor out = at::empty(residual.sizes(), residual.options());
  const int64_t hidden = residual.size(1);
  const int64_t rstride = residual.stride(0), ustride = update.stride(0);
  uint16_t* rp = bf16_data_mut(residual);
  const uint16_t *up = bf16_data(update), *wp = bf16_data(weight);
  uint16_t* op = bf16_data_mut(out);
  const auto feps = static_cast<float>(eps);
  for_rows(residual.size(0), hidden, [&](int64_t row) {
    uint16_t* r = rp + row * rstride;
    const uint16_t* u = up + row * ustride;
    for (int64_t c = 0; c < hidden; c += kLanes)
      store_bf16(r + c, _mm512_add_ps(widen_bf16(r + c), widen_bf16(u + c)));
    norm_row(r, wp, hidden, feps, op + row * hidden);
  });
  return out;
}

void rotary_(at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t q_heads,
             int64_t kv_heads) {
  constexpr int64_t kDim = kRotaryDim, kHalf = kRotaryHalf;
  kCheck.rotary(qkv, cos, sin, q_heads, kv_heads);
  const int64_t rotated = q_heads + kv_heads, stride = qkv.stride(0);
  uint16_t* xp = bf16_data_mut(qkv);
  const uint16_t *cp = bf16_data(cos), *sp = bf16_data(sin);
  for_rows(qkv.size(0), rotated * kDim, [&](int64_t token) {
    __m512 c[2], s[2];
    for (int64_t i = 0; i < 2; ++i) {
      c[i] = widen_bf16(cp + token * kHalf + i * kLanes);
      s[i] = widen_bf16(sp + token * kHalf + i * kLanes);
    }
    for (int64_t head = 0; head < rotated; ++head) {
      uint16_t* x = xp + token * stride + head * kDim;
      for (int64_t i = 0; i < 2; ++i) {
        const __m512 x1 = widen_bf16(x + i * kLanes), x2 = widen_bf16(x + kHalf + i * kLanes);
        // As torch in bf16: each product rounded, then their difference and sum.
        const __m512 first = _mm512_sub_ps(round_bf16(_mm512_mul_ps(x1, c[i])),
                                           round_bf16(_mm512_mul_ps(x2, s[i])));
        const __m512 second = _mm512_add_ps(round_bf16(_mm512_mul_ps(x2, c[i])),
                                            round_bf16(_mm512_mul_ps(x1, s[i])));
        store_bf16(x + i * kLanes, first);
        store_bf16(x + kHalf + i * kLanes, second);
      }
    }
  });
}

// silu(g) = g · sigmoid(g), sigmoid from exp(−|g|) so that exp never overflows.
inline __m512 silu(__m512 g) {
  const __m512 magnitude = _mm512_abs_ps(g);
  const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_setzero_ps(), magnitude));
  const __m512 one = _mm512_set1_ps(1.0f);
  const __m512 inverse = _mm512_div_ps(one, _mm512_add_ps(one, e));
  const __mmask16 negative = _mm512_cmp_ps_mask(g, _mm512_setzero_ps(), _CMP_LT_OQ);
  const __m512 sigmoid = _mm512_mask_mul_ps(inverse, negative, inverse, e);
  return _mm512_mul_ps(g, sigmoid);
}

at::Tensor silu_and_mul(const at::Tensor& gate_up) {
  kCheck.gate_up(gate_up);
  const int64_t width = gate_up.size(1) / 2, stride = gate_up.stride(0);
  at::Tensor out = at::empty({gate_up.size(0), width}, gate_up.options());
  const uint16_t* gp = bf16_data(gate_up);
  uint16_t* op = bf16_data_mut(out);
  for_rows(gate_up.size(0), width, [&](int64_t row) {
    const uint16_t* gate = gp + row * stride;
    for (int64_t c = 0; c < width; c += kLanes) {
      const __m512 activated = round_bf16(silu(widen_bf16(gate + c)));
      store_bf16(op + row * width + c, _mm512_mul_ps(activated, widen_bf16(gate + width + c)));
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(blockserve_cpu, m) { define_layer(m); }

TORCH_LIBRARY_IMPL(blockserve_cpu, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("rotary_", &rotary_);
  m.impl("silu_and_mul", &silu_and_mul);
}
