// The elementwise math of a Llama layer, fused, for bfloat16 on x86 CPUs with AVX512-BF16:
// RMSNorm (alone, or after the residual add), the rotary embedding of q and k in place, and
// SiLU(gate) * up; and the argmax of greedy sampling and the K/V cache write (layer_ops.h).
// An eager forward spends ~20 torch operators a layer on these, each a pass over memory and a
// dispatch; here each is one pass.
//
// The operators' shapes are in layer_ops.h. Every result equals torch's bf16 composition
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
#include <cstring>

#include "bf16.h"
#include "layer_ops.h"
#include "lora.h"

namespace {

using namespace blockserve_cpu;

constexpr int64_t kLanes = 16;

struct Bf16Layer {
  using Elem = uint16_t;
  static constexpr LayerChecks kCheck{at::kBFloat16, "bfloat16"};

  // out = weight * bf16(x * rsqrt(mean(x²) + eps)).
  static void norm_row(const uint16_t* x, const uint16_t* weight, int64_t hidden, float eps,
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

  static void add_row(uint16_t* residual, const uint16_t* update, int64_t hidden) {
    for (int64_t c = 0; c < hidden; c += kLanes)
      store_bf16(residual + c, _mm512_add_ps(widen_bf16(residual + c), widen_bf16(update + c)));
  }

  static void rotate_token(uint16_t* x, const uint16_t* cos, const uint16_t* sin,
                           int64_t heads) {
    constexpr int64_t kVectors = kRotaryHalf / kLanes;
    __m512 c[kVectors], s[kVectors];
    for (int64_t i = 0; i < kVectors; ++i) {
      c[i] = widen_bf16(cos + i * kLanes);
      s[i] = widen_bf16(sin + i * kLanes);
    }
    for (int64_t head = 0; head < heads; ++head, x += kRotaryDim) {
      for (int64_t i = 0; i < kVectors; ++i) {
        const __m512 x1 = widen_bf16(x + i * kLanes);
        const __m512 x2 = widen_bf16(x + kRotaryHalf + i * kLanes);
        // As torch in bf16: each product rounded, then their difference and sum.
        const __m512 first = _mm512_sub_ps(round_bf16(_mm512_mul_ps(x1, c[i])),
                                           round_bf16(_mm512_mul_ps(x2, s[i])));
        const __m512 second = _mm512_add_ps(round_bf16(_mm512_mul_ps(x2, c[i])),
                                            round_bf16(_mm512_mul_ps(x1, s[i])));
        store_bf16(x + i * kLanes, first);
        store_bf16(x + kRotaryHalf + i * kLanes, second);
      }
    }
  }

  static void silu_mul_row(const uint16_t* gate, int64_t width, uint16_t* out) {
    for (int64_t c = 0; c < width; c += kLanes) {
      const __m512 activated = round_bf16(silu(widen_bf16(gate + c)));
      store_bf16(out + c, _mm512_mul_ps(activated, widen_bf16(gate + width + c)));
    }
  }

  static int64_t argmax_row(const uint16_t* x, int64_t n) {
    const int64_t whole = n / kLanes * kLanes;
    __m512 best = _mm512_set1_ps(-INFINITY);
    __m512i at = _mm512_setzero_si512();
    __m512i index = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __mmask16 nan = 0;
    for (int64_t c = 0; c < whole; c += kLanes) {
      const __m512 v = widen_bf16(x + c);
      const __mmask16 larger = _mm512_cmp_ps_mask(v, best, _CMP_GT_OQ);
      nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
      best = _mm512_mask_mov_ps(best, larger, v);
      at = _mm512_mask_mov_epi32(at, larger, index);
      index = _mm512_add_epi32(index, _mm512_set1_epi32(kLanes));
    }
    alignas(64) float lane_best[kLanes];
    alignas(64) int32_t lane_at[kLanes];
    _mm512_store_ps(lane_best, best);
    _mm512_store_si512(lane_at, at);
    const auto value = [x](int64_t i) {
      const uint32_t bits = static_cast<uint32_t>(x[i]) << 16;
      float widened;
      std::memcpy(&widened, &bits, sizeof(widened));
      return widened;
    };
    return finish_argmax<kLanes>(lane_best, lane_at, nan != 0, whole, n, value);
  }
};

// silu_and_mul of a widened gate/up product's float32 sums [rows, 2n] → [rows, n] bf16: the bits
// of rounding the sums to bf16, then silu_and_mul, without writing the rounded product.
at::Tensor silu_and_mul_sums(const at::Tensor& sums) {
  TORCH_CHECK(sums.dim() == 2 && sums.scalar_type() == at::kFloat && sums.size(1) % 32 == 0 &&
                  sums.stride(1) == 1,
              "silu_and_mul_sums: sums must be float32 [rows, 2n], n a multiple of 16, with "
              "unit stride along a row");
  const int64_t width = sums.size(1) / 2, stride = sums.stride(0);
  at::Tensor out = at::empty({sums.size(0), width}, sums.options().dtype(at::kBFloat16));
  const float* sp = sums.data_ptr<float>();
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr());
  for_rows(sums.size(0), width, [&](int64_t row) {
    const float* gate = sp + row * stride;
    for (int64_t c = 0; c < width; c += kLanes)
      store_bf16(op + row * width + c,
                 silu_mul_sums(_mm512_loadu_ps(gate + c), _mm512_loadu_ps(gate + width + c)));
  });
  return out;
}

}  // namespace

// LoRA's grouped products (lora.h), registered here: a translation unit of their own would
// parse torch's headers again, ~9 s of every build.
namespace {

void lora_add_bf16(const at::Tensor& x, at::Tensor& out, const at::Tensor& a, const at::Tensor& b,
                   const at::Tensor& src, const at::Tensor& starts, const at::Tensor& slots,
                   at::IntArrayRef bounds, int64_t rank) {
  blockserve_cpu::lora::lora_add_<uint16_t>(x, out, a, b, src, starts, slots, bounds, rank,
                                      at::kBFloat16);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(blockserve_cpu, m) {
  define_layer(m);
  m.def("silu_and_mul_sums(Tensor sums) -> Tensor");
  blockserve_cpu::lora::define_lora(m);
}

TORCH_LIBRARY_IMPL(blockserve_cpu, CPU, m) {
  implement_layer<Bf16Layer>(m);
  m.impl("silu_and_mul_sums", &silu_and_mul_sums);
  m.impl("lora_add_", &lora_add_bf16);
}
