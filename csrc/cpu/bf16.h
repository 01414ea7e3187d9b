// Vector helpers shared by our AVX512-BF16 kernels (attention, layer operators, products);
// their exponentials are in exp2.h.
#pragma once

#include <immintrin.h>

#include <cstdint>

#include "exp2.h"

namespace blockserve_cpu {

inline __m512bh as_bh(__m512i v) { return reinterpret_cast<__m512bh>(v); }

inline __m512 widen_bf16(const uint16_t* p) {  // 16 bf16 → 16 f32 (exact)
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

// 16 bf16 pairs (one a 32-bit lane) → each pair's first element (its low half), then its
// second (the high half), as 16 f32: exact. Two FMAs over them, second then first, give the
// bits `vdpbf16ps` gives over the pairs (its products are exact; it flushes denormals).
inline __m512 pair_firsts(__m512i pairs) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16));
}
inline __m512 pair_seconds(__m512i pairs) {
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xffff0000u));
  return _mm512_castsi512_ps(_mm512_and_si512(pairs, high));
}

// 16 f32 → 16 bf16, rounded to nearest even (as torch rounds).
inline void store_bf16(uint16_t* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)));
}

// v rounded to bf16 and back: what a torch op in bf16 leaves between two steps.
inline __m512 round_bf16(__m512 v) {
  const __m256i half = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
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

// SiLU(gate) · up where gate and up are a product's float32 sums: each rounded to bf16 first, as
// the product alone would write them, then as silu_and_mul computes: the bits of the two.
inline __m512 silu_mul_sums(__m512 gate, __m512 up) {
  return _mm512_mul_ps(round_bf16(silu(round_bf16(gate))), round_bf16(up));
}

}  // namespace blockserve_cpu
