// Linear layers of few rows (decode steps) in float32: y = x · Wᵀ (+ bias), on `Vec`
// (f32.h): eight lanes in the AVX2 build, sixteen in the AVX-512F one.
//
// A decode step's products read every weight of the model once for a few dozen rows. On the
// host measured, oneDNN's float32 products of a whole decode step of 1 to 64 rows read the
// weights at 7-19 GB/s where a plain read reaches ~25 (docs/benchmarks.md, "Float32 on
// AVX-512F").
// Here the weight is repacked once into panels of 2 vectors of columns, [N / panel][K][panel],
// so that a thread's share of the weight is one sequential stream. Each thread takes a run of
// panels; a panel's rows of x go through it kRows at a time (a register tile of kRows × 2
// vectors, a broadcast of x and two FMAs per row and step of k), the first pass reading the
// panel from memory, the later ones from cache. While a panel is worked on, the next one is
// fetched into L2, spread over its passes, so that memory streams while the FMAs run.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <optional>

#include "f32.h"

namespace {

using namespace blockserve_cpu;

constexpr int64_t kWidth = Vec::kLanes;
constexpr int64_t kPanel = 2 * kWidth;             // columns of W a panel holds
constexpr int64_t kRows = kWidth == 16 ? 12 : 6;  // rows of a pass: 24 (12) accumulators
constexpr int64_t kMultiple = 32;                  // of columns either build takes
constexpr int64_t kLine = 64 / sizeof(float);      // floats of a cache line

// W [N, K] row-major → panels: W[p · panel + c][i] at (p · K + i) · panel + c.
at::Tensor vector_pack(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat,
              "vector_pack: the weight must be 2-D float32");
  const int64_t n = weight.size(0), k = weight.size(1);
  TORCH_CHECK(n % kMultiple == 0, "vector_pack: ", n, " rows is not a multiple of 32");
  const at::Tensor w = weight.contiguous();
  at::Tensor packed = at::empty_like(w);
  const float* src = w.data_ptr<float>();
  float* dst = packed.data_ptr<float>();
  at::parallel_for(0, n / kPanel, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p)
      for (int64_t i = 0; i < k; ++i)
        for (int64_t c = 0; c < kPanel; ++c)
          dst[(p * k + i) * kPanel + c] = src[(p * kPanel + c) * k + i];
  });
  return packed;
}

// Where a pass is: the panel's rows of x, the panel, the next panel to fetch (or none) and
// which share of its lines this pass fetches.
struct Pass {
  const float* x;  // its first row; rows k apart
  const float* panel;
  const float* next;
  int64_t k, passes, pass;
};

// y[R][panel] = x[R][k] · panel (+ bias): R rows of one pass.
template <int R>
void pass_rows(const Pass& at, const float* bias, float* y, int64_t y_stride) {
  Vec::T acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = Vec::zero();
  // This pass fetches the next panel's rows pass, pass + passes, ...: a countdown to each.
  int64_t until_fetch = at.next != nullptr ? at.pass : at.k;
  for (int64_t i = 0; i < at.k; ++i) {
    const float* row = at.panel + i * kPanel;
    const Vec::T b0 = Vec::load(row), b1 = Vec::load(row + kWidth);
    if (until_fetch-- == 0) {  // the next panel's row i
      for (int64_t line = 0; line < kPanel; line += kLine)
        _mm_prefetch(reinterpret_cast<const char*>(at.next + i * kPanel + line), _MM_HINT_T1);
      until_fetch = at.passes - 1;
    }
    for (int r = 0; r < R; ++r) {
      const Vec::T x = Vec::set1(at.x[r * at.k + i]);
      acc[r][0] = Vec::fmadd(x, b0, acc[r][0]);
      acc[r][1] = Vec::fmadd(x, b1, acc[r][1]);
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int h = 0; h < 2; ++h) {
      Vec::T out = acc[r][h];
      if (bias != nullptr) out = Vec::add(out, Vec::load(bias + h * kWidth));
      Vec::store(y + r * y_stride + h * kWidth, out);
    }
  }
}

// A pass of `rows` (1 to R) rows.
template <int R>
void pass_any(int64_t rows, const Pass& at, const float* bias, float* y, int64_t y_stride) {
  if constexpr (R > 1) {
    if (rows < R) return pass_any<R - 1>(rows, at, bias, y, y_stride);
  }
  pass_rows<R>(at, bias, y, y_stride);
}

//   x [rows, k] float32 (rows of any stride, unit along k), packed: vector_pack(W) for W
//   [n, k], bias [n] or none → [rows, n] float32.
at::Tensor vector_linear(const at::Tensor& x, const at::Tensor& packed,
                         const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && packed.dim() == 2 &&
                  packed.scalar_type() == at::kFloat,
              "vector_linear: x [rows, k] and the packed weight [n, k] must be float32");
  const int64_t rows = x.size(0), k = x.size(1), n = packed.size(0);
  TORCH_CHECK(packed.size(1) == k && packed.is_contiguous(), "vector_linear: x has ", k,
              " columns, the weight ", packed.size(1));
  TORCH_CHECK(n % kMultiple == 0, "vector_linear: ", n, " columns is not a multiple of 32");
  TORCH_CHECK(!bias || (bias->dim() == 1 && bias->size(0) == n &&
                        bias->scalar_type() == at::kFloat),
              "vector_linear: bias must be float32 [", n, "]");
  at::Tensor out = at::empty({rows, n}, x.options());
  if (rows == 0) return out;
  const at::Tensor left = x.contiguous();
  const at::Tensor shift = bias ? bias->contiguous() : at::Tensor();
  const float* xs = left.data_ptr<float>();
  const float* ws = packed.data_ptr<float>();
  const float* bs = bias ? shift.data_ptr<float>() : nullptr;
  float* ys = out.data_ptr<float>();
  const int64_t passes = (rows + kRows - 1) / kRows;
  at::parallel_for(0, n / kPanel, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const float* panel = ws + p * k * kPanel;
      const float* next = p + 1 < end ? panel + k * kPanel : nullptr;
      for (int64_t pass = 0; pass < passes; ++pass) {
        const int64_t row0 = pass * kRows;
        const Pass at{xs + row0 * k, panel, next, k, passes, pass};
        pass_any<kRows>(std::min(kRows, rows - row0), at, bs ? bs + p * kPanel : nullptr,
                        ys + row0 * n + p * kPanel, n);
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(BLOCKSERVE_F32_OPS, m) {
  m.def("vector_pack(Tensor weight) -> Tensor");
  m.def("vector_linear(Tensor x, Tensor packed, Tensor? bias) -> Tensor");
}

TORCH_LIBRARY_IMPL(BLOCKSERVE_F32_OPS, CPU, m) {
  m.impl("vector_pack", &vector_pack);
  m.impl("vector_linear", &vector_linear);
}
