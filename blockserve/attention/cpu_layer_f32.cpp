// The elementwise math of a Llama layer, fused, for float32 on x86 CPUs with AVX2 and FMA:
// the same four operators as cpu_layer_bf16.cpp (shapes in cpu_layer.h), for models served
// in float32. Each is one pass over memory where torch's float32 composition (model/llama.py)
// is several operators.
//
// The library is built with -ffp-contract=off, so a product followed by a sum stays two
// roundings as in torch's operators: the rotary embedding equals torch's to the bit, RMSNorm
// differs in the order its mean of squares is summed (an ulp or so), and SiLU in its exp.

#include <immintrin.h>

#include <cmath>
#include <cstdint>

#include "cpu_f32_common.h"
#include "cpu_layer.h"

namespace {

using namespace blockserve_cpu;

constexpr LayerChecks kCheck{at::kFloat, "float32"};

// One row: out = weight * (x * rsqrt(mean(x²) + eps)).
inline void norm_row(const float* x, const float* weight, int64_t hidden, float eps, float* out) {
  __m256 squares = _mm256_setzero_ps();
  for (int64_t c = 0; c < hidden; c += kLanes) {
    const __m256 v = _mm256_loadu_ps(x + c);
    squares = _mm256_fmadd_ps(v, v, squares);
  }
  const float mean = sum_lanes(squares) / static_cast<float>(hidden);
  const __m256 inverse = _mm256_set1_ps(1.0f / std::sqrt(mean + eps));
  for (int64_t c = 0; c < hidden; c += kLanes) {
    const __m256 normed = _mm256_mul_ps(_mm256_loadu_ps(x + c), inverse);
    _mm256_storeu_ps(out + c, _mm256_mul_ps(_mm256_loadu_ps(weight + c), normed));
  }
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  kCheck.rows(x, "x");
  kCheck.weight(x, weight);
  at::Tensor out = at::empty(x.sizes(), x.options());
  const int64_t hidden = x.size(1), stride = x.stride(0);
  const float *xp = x.data_ptr<float>(), *wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
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
  float* rp = residual.data_ptr<float>();
  const float *up = update.data_ptr<float>(), *wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const auto feps = static_cast<float>(eps);
  for_rows(residual.size(0), hidden, [&](int64_t row) {
    float* r = rp + row * rstride;
    const float* u = up + row * ustride;
    for (int64_t c = 0; c < hidden; c += kLanes)
      _mm256_storeu_ps(r + c, _mm256_add_ps(_mm256_loadu_ps(r + c), _mm256_loadu_ps(u + c)));
    norm_row(r, wp, hidden, feps, op + row * hidden);
  });
  return out;
}

void rotary_(at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t q_heads,
             int64_t kv_heads) {
  kCheck.rotary(qkv, cos, sin, q_heads, kv_heads);
  constexpr int64_t kVectors = kRotaryHalf / kLanes;
  const int64_t rotated = q_heads + kv_heads, stride = qkv.stride(0);
  float* xp = qkv.data_ptr<float>();
  const float *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
  for_rows(qkv.size(0), rotated * kRotaryDim, [&](int64_t token) {
    __m256 c[kVectors], s[kVectors];
    for (int64_t i = 0; i < kVectors; ++i) {
      c[i] = _mm256_loadu_ps(cp + token * kRotaryHalf + i * kLanes);
      s[i] = _mm256_loadu_ps(sp + token * kRotaryHalf + i * kLanes);
    }
    for (int64_t head = 0; head < rotated; ++head) {
      float* x = xp + token * stride + head * kRotaryDim;
      for (int64_t i = 0; i < kVectors; ++i) {
        const __m256 x1 = _mm256_loadu_ps(x + i * kLanes);
        const __m256 x2 = _mm256_loadu_ps(x + kRotaryHalf + i * kLanes);
        const __m256 first = _mm256_sub_ps(_mm256_mul_ps(x1, c[i]), _mm256_mul_ps(x2, s[i]));
        const __m256 second = _mm256_add_ps(_mm256_mul_ps(x2, c[i]), _mm256_mul_ps(x1, s[i]));
        _mm256_storeu_ps(x + i * kLanes, first);
        _mm256_storeu_ps(x + kRotaryHalf + i * kLanes, second);
      }
    }
  });
}

// silu(g) = g · sigmoid(g), sigmoid from exp(−|g|) so that exp never overflows.
inline __m256 silu(__m256 g) {
  const __m256 zero = _mm256_setzero_ps(), one = _mm256_set1_ps(1.0f);
  const __m256 magnitude = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), g);
  const __m256 e = exp_nonpositive(_mm256_sub_ps(zero, magnitude));
  const __m256 inverse = _mm256_div_ps(one, _mm256_add_ps(one, e));
  const __m256 negative = _mm256_cmp_ps(g, zero, _CMP_LT_OQ);
  const __m256 sigmoid = _mm256_blendv_ps(inverse, _mm256_mul_ps(inverse, e), negative);
  return _mm256_mul_ps(g, sigmoid);
}

at::Tensor silu_and_mul(const at::Tensor& gate_up) {
  kCheck.gate_up(gate_up);
  const int64_t width = gate_up.size(1) / 2, stride = gate_up.stride(0);
  at::Tensor out = at::empty({gate_up.size(0), width}, gate_up.options());
  const float* gp = gate_up.data_ptr<float>();
  float* op = out.data_ptr<float>();
  for_rows(gate_up.size(0), width, [&](int64_t row) {
    const float* gate = gp + row * stride;
    for (int64_t c = 0; c < width; c += kLanes) {
      const __m256 activated = silu(_mm256_loadu_ps(gate + c));
      _mm256_storeu_ps(op + row * width + c,
                       _mm256_mul_ps(activated, _mm256_loadu_ps(gate + width + c)));
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(blockserve_cpu_f32, m) { define_layer(m); }

TORCH_LIBRARY_IMPL(blockserve_cpu_f32, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("rotary_", &rotary_);
  m.impl("silu_and_mul", &silu_and_mul);
}
