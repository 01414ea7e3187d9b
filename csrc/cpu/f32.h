// Vector helpers shared by our float32 kernels (attention_f32.cpp, layer_ops_f32.cpp): eight
// float32 lanes to a register with AVX2 and FMA, and `Vec`, the widest vector the library is
// built for: sixteen lanes in its AVX-512F build (hosts that have it), else those eight.
#pragma once

#include <immintrin.h>

#include <cstdint>

#include "exp2.h"

// The torch.ops namespace of the build's operators (blockserve/kernels/build.py names each build's).
#ifndef BLOCKSERVE_F32_OPS
#define BLOCKSERVE_F32_OPS blockserve_cpu_f32
#endif

namespace blockserve_cpu {

constexpr int64_t kLanes = 8;

// exp(x) for x <= 0 (scores minus their running maximum, minus a magnitude): 2^(x log2 e)
// split into an integer power, built in the exponent bits, and 2^f for f in [-0.5, 0.5]
// (exp2.h). Arguments below -87 give ~1e-38, which a caller zeroes where it matters
// (masked keys).
inline __m256 exp_nonpositive(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  const __m256 t = _mm256_mul_ps(x, _mm256_set1_ps(kLog2E));
  const __m256 whole = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 f = _mm256_sub_ps(t, whole);
  __m256 p = _mm256_set1_ps(kExp2Poly[0]);
  for (int i = 1; i < kExp2Terms; ++i) p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(kExp2Poly[i]));
  const __m256i power = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(whole), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(power));
}

inline float sum_lanes(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

inline float max_lanes(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}

// What the attention kernels compute on, whatever its width.
struct Vec {
#ifdef __AVX512F__
  using T = __m512;
  static constexpr int64_t kLanes = 16;
  static T zero() { return _mm512_setzero_ps(); }
  static T set1(float x) { return _mm512_set1_ps(x); }
  static T load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, T v) { _mm512_storeu_ps(p, v); }
  static T fmadd(T a, T b, T c) { return _mm512_fmadd_ps(a, b, c); }
  static T mul(T a, T b) { return _mm512_mul_ps(a, b); }
  static T add(T a, T b) { return _mm512_add_ps(a, b); }
  static T sub(T a, T b) { return _mm512_sub_ps(a, b); }
  static T max(T a, T b) { return _mm512_max_ps(a, b); }
  static T exp(T x) { return exp_nonpositive(x); }  // x <= 0
  static float sum(T v) { return _mm512_reduce_add_ps(v); }
  static float max_of(T v) { return _mm512_reduce_max_ps(v); }
#else
  using T = __m256;
  static constexpr int64_t kLanes = blockserve_cpu::kLanes;
  static T zero() { return _mm256_setzero_ps(); }
  static T set1(float x) { return _mm256_set1_ps(x); }
  static T load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, T v) { _mm256_storeu_ps(p, v); }
  static T fmadd(T a, T b, T c) { return _mm256_fmadd_ps(a, b, c); }
  static T mul(T a, T b) { return _mm256_mul_ps(a, b); }
  static T add(T a, T b) { return _mm256_add_ps(a, b); }
  static T sub(T a, T b) { return _mm256_sub_ps(a, b); }
  static T max(T a, T b) { return _mm256_max_ps(a, b); }
  static T exp(T x) { return exp_nonpositive(x); }  // x <= 0
  static float sum(T v) { return sum_lanes(v); }
  static float max_of(T v) { return max_lanes(v); }
#endif
};

}  // namespace blockserve_cpu
