// Vector helpers shared by our AVX512-BF16 kernels (cpu_dense_bf16.cpp, cpu_layer_bf16.cpp).
#pragma once

#include <immintrin.h>

#include <cstdint>

#include "cpu_exp2.h"

namespace blockserve_cpu {

// 2^t for t <= 0: an integer power, applied by `scalef`, times 2^f for f in [-0.5, 0.5]
// (cpu_exp2.h). t below -126 gives 2^-126, the least normal float (~0), as -inf does.
inline __m512 exp2_nonpositive(__m512 t) {
  t = _mm512_max_ps(t, _mm512_set1_ps(-126.0f));
  const __m512 whole = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, whole);
  __m512 p = _mm512_set1_ps(kExp2Poly[0]);
  for (int i = 1; i < kExp2Terms; ++i) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(kExp2Poly[i]));
  return _mm512_scalef_ps(p, whole);
}

// exp(x) for x <= 0 (scores minus their running maximum) as 2^(x log2 e): arguments below
// -87 give ~0.
inline __m512 exp_nonpositive(__m512 x) {
  return exp2_nonpositive(_mm512_mul_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)),
                                        _mm512_set1_ps(kLog2E)));
}

inline __m512bh as_bh(__m512i v) { return reinterpret_cast<__m512bh>(v); }

inline __m512 widen_bf16(const uint16_t* p) {  // 16 bf16 → 16 f32 (exact)
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
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

}  // namespace blockserve_cpu
