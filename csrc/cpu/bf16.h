// Vector helpers shared by our AVX512-BF16 kernels (attention_bf16.cpp, layer_ops_bf16.cpp);
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
