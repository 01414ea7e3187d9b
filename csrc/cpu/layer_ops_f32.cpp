// The elementwise math of a Llama layer, fused, for float32 on x86 CPUs with AVX2 and FMA:
// the same operators as layer_ops_bf16.cpp (shapes in layer_ops.h), for models served
// in float32. Each is one pass over memory where torch's float32 composition (model/llama.py)
// is several operators.
//
// The library is built with -ffp-contract=off, so a product followed by a sum stays two
// roundings as in torch's operators: the rotary embedding equals torch's to the bit, RMSNorm
// differs in the order its mean of squares is summed (an ulp or so), and SiLU in its exp.

#include <immintrin.h>

#include <cmath>
#include <cstdint>

#include "f32.h"
#include "layer_ops.h"
#include "lora.h"

namespace {

using namespace blockserve_cpu;

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

struct F32Layer {
  using Elem = float;
  static constexpr LayerChecks kCheck{at::kFloat, "float32"};

  // out = weight * (x * rsqrt(mean(x²) + eps)).
  static void norm_row(const float* x, const float* weight, int64_t hidden, float eps,
                       float* out) {
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

  static void add_row(float* residual, const float* update, int64_t hidden) {
    for (int64_t c = 0; c < hidden; c += kLanes) {
      _mm256_storeu_ps(residual + c,
                       _mm256_add_ps(_mm256_loadu_ps(residual + c), _mm256_loadu_ps(update + c)));
    }
  }

  static void rotate_token(float* x, const float* cos, const float* sin, int64_t heads) {
    constexpr int64_t kVectors = kRotaryHalf / kLanes;
    __m256 c[kVectors], s[kVectors];
    for (int64_t i = 0; i < kVectors; ++i) {
      c[i] = _mm256_loadu_ps(cos + i * kLanes);
      s[i] = _mm256_loadu_ps(sin + i * kLanes);
    }
    for (int64_t head = 0; head < heads; ++head, x += kRotaryDim) {
      for (int64_t i = 0; i < kVectors; ++i) {
        const __m256 x1 = _mm256_loadu_ps(x + i * kLanes);
        const __m256 x2 = _mm256_loadu_ps(x + kRotaryHalf + i * kLanes);
        const __m256 first = _mm256_sub_ps(_mm256_mul_ps(x1, c[i]), _mm256_mul_ps(x2, s[i]));
        const __m256 second = _mm256_add_ps(_mm256_mul_ps(x2, c[i]), _mm256_mul_ps(x1, s[i]));
        _mm256_storeu_ps(x + i * kLanes, first);
        _mm256_storeu_ps(x + kRotaryHalf + i * kLanes, second);
      }
    }
  }

  static void silu_mul_row(const float* gate, int64_t width, float* out) {
    for (int64_t c = 0; c < width; c += kLanes) {
      const __m256 activated = silu(_mm256_loadu_ps(gate + c));
      _mm256_storeu_ps(out + c, _mm256_mul_ps(activated, _mm256_loadu_ps(gate + width + c)));
    }
  }

  static int64_t argmax_row(const float* x, int64_t n) {
    const int64_t whole = n / kLanes * kLanes;
    __m256 best = _mm256_set1_ps(-INFINITY);
    __m256 at = _mm256_setzero_ps();  // int32 indices, blended as floats' bits
    __m256i index = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    __m256 nan = _mm256_setzero_ps();
    for (int64_t c = 0; c < whole; c += kLanes) {
      const __m256 v = _mm256_loadu_ps(x + c);
      const __m256 larger = _mm256_cmp_ps(v, best, _CMP_GT_OQ);
      nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
      best = _mm256_blendv_ps(best, v, larger);
      at = _mm256_blendv_ps(at, _mm256_castsi256_ps(index), larger);
      index = _mm256_add_epi32(index, _mm256_set1_epi32(kLanes));
    }
    alignas(32) float lane_best[kLanes];
    alignas(32) int32_t lane_at[kLanes];
    _mm256_store_ps(lane_best, best);
    _mm256_store_si256(reinterpret_cast<__m256i*>(lane_at), _mm256_castps_si256(at));
    return finish_argmax<kLanes>(lane_best, lane_at, _mm256_movemask_ps(nan) != 0, whole, n,
                                 [x](int64_t i) { return x[i]; });
  }
};

}  // namespace

// LoRA's grouped products (lora.h), registered here: a translation unit of their own would
// parse torch's headers again, ~9 s of every build.
namespace {

void lora_add_f32(const at::Tensor& x, at::Tensor& out, const at::Tensor& a, const at::Tensor& b,
                  const at::Tensor& src, const at::Tensor& starts, const at::Tensor& slots,
                  at::IntArrayRef bounds, int64_t rank) {
  blockserve_cpu::lora::lora_add_<float>(x, out, a, b, src, starts, slots, bounds, rank, at::kFloat);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(BLOCKSERVE_F32_OPS, m) {
  define_layer(m);
  blockserve_cpu::lora::define_lora(m);
}

TORCH_LIBRARY_IMPL(BLOCKSERVE_F32_OPS, CPU, m) {
  implement_layer<F32Layer>(m);
  m.impl("lora_add_", &lora_add_f32);
}
