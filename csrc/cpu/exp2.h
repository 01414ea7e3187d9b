// The polynomial both libraries' exponentials use: 2^f for f in [-0.5, 0.5], of degree 5,
// highest power first (Horner's order). Its coefficients minimize the largest relative error
// over the interval (Lawson's iteration on 4,001 Chebyshev points): 7.5e-8 exactly, 2.1e-7
// evaluated in float32 with FMAs, the same as the degree-6 Taylor series it replaced
// (2.2e-7 in float32), one FMA a vector fewer. Where the library is built for AVX-512F, the
// sixteen-lane exponentials are here too (the bf16 library's, and the float32 library's
// AVX-512 build).
#pragma once

#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace blockserve_cpu {

constexpr float kLog2E = 1.4426950408889634f;
constexpr int kExp2Terms = 6;
constexpr float kExp2Poly[kExp2Terms] = {
    1.3276471737118996e-3f, 9.6755415400252560e-3f, 5.5507132760938244e-2f,
    2.4022119720076088e-1f, 6.9314696706204170e-1f, 1.0000000716554325f,
};

#ifdef __AVX512F__
// 2^t for t <= 0: an integer power, applied by `scalef`, times 2^f for f in [-0.5, 0.5]. t
// below -126 gives 2^-126, the least normal float (~0), as -inf does.
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
#endif

}  // namespace blockserve_cpu
