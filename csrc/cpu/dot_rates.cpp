// How fast this core runs bf16 dot products (vdpbf16ps) against float32 FMAs, in GFLOP/s.
//
// The two are not in a fixed ratio across CPUs: on some an AVX512-BF16 dot product (64 FLOPs)
// issues once where two float32 FMAs (32 FLOPs each) issue, and a bf16 product is then no
// faster than one in float32; on others it issues as often as an FMA and is twice as fast.
// Where float32 wins clearly, a prefill's bf16 products run faster widened to float32
// (blockserve/model/weight_copies.py, "wide" copies), which is what this is asked for.
//
// Each rate: twelve independent accumulators (more than an instruction's latency × its
// issue rate), no memory operands, the best of five timed runs of kIterations each (about
// 0.2 ms a run), on the calling thread.

#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <chrono>
#include <vector>

namespace {

constexpr int kAccumulators = 12;
constexpr long kIterations = 20000;
constexpr int kRuns = 5;

// GFLOP/s of one timed run of `step(accumulator, operand)`, an instruction of `flops` FLOPs.
template <class Step>
double rate(Step step, double flops) {
  __m512 sums[kAccumulators];
  for (auto& sum : sums) {
    sum = _mm512_setzero_ps();
    asm volatile("" : "+v"(sum));  // twelve sums the compiler cannot tell are equal
  }
  __m512 operand = _mm512_set1_ps(1.0f);
  const auto started = std::chrono::steady_clock::now();
  for (long i = 0; i < kIterations; ++i) {
#pragma GCC unroll 12
    for (auto& sum : sums) sum = step(sum, operand);
    asm volatile("" : "+v"(operand));  // not hoisted: the loop stays kIterations long
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
  for (auto& sum : sums) asm volatile("" : : "v"(sum));  // the sums are kept
  return kIterations * kAccumulators * flops / seconds / 1e9;
}

// [bf16 dot products' GFLOP/s, float32 FMAs' GFLOP/s] on one core, the best of kRuns each,
// the two taking turns (a neighbour's burst slows both alike).
std::vector<double> dot_rates() {
  double bf16 = 0.0, f32 = 0.0;
  for (int run = 0; run < kRuns; ++run) {
    bf16 = std::max(bf16, rate(
                              [](__m512 sum, __m512 x) {
                                return _mm512_dpbf16_ps(sum, reinterpret_cast<__m512bh>(x),
                                                        reinterpret_cast<__m512bh>(x));
                              },
                              64.0));
    f32 = std::max(f32, rate([](__m512 sum, __m512 x) { return _mm512_fmadd_ps(x, x, sum); },
                             32.0));
  }
  return {bf16, f32};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(blockserve_cpu, m) { m.def("dot_rates() -> float[]", &dot_rates); }
