// LoRA's grouped products for one projection of a step (blockserve/lora/layers.py), either
// element type: the step's adapter tokens come in groups, one per adapter slot, and
//
//   lora_add_(x [N, in], out [N, width] (in place), a [S, in, K R], b [S, K R, width],
//             src [M], starts [G + 1], slots [G], bounds [K + 1], rank R):
//     for group g, slot s = slots[g], each token row = src[m], starts[g] <= m < starts[g + 1]:
//     t = x[row] · a[s] (float32), then for each module k (output columns
//     bounds[k]..bounds[k + 1]) out[row, those columns] += t[k R .. k R + R] · b[s, those rows,
//     those columns], summed in float32 and rounded once into `out`.
//
// `b` is block-diagonal (module k's B under its R rows, over its columns); only its blocks are
// read, so a fused projection of K modules reads 1/K of the stack torch's bmm reads. Work is
// split in two passes over threads: the shrink by (group, a tile of tokens), the expand by
// (group, module, up to kColumns columns), whose slice of b stays in L1 across the group's
// tokens. Loops are plain and left to the compiler's vectorizer (-O3 and the build's ISA).
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace blockserve_cpu::lora {
namespace {

// Sixteen floats, as GCC's vector extension: one register on AVX-512, two on AVX2.
using vf = float __attribute__((vector_size(64)));
using vu = uint32_t __attribute__((vector_size(64)));
using vh = uint16_t __attribute__((vector_size(32)));
constexpr int64_t kLanes = 16;
#ifdef __AVX512F__  // register tiles: tokens × vectors of accumulators, within the registers
constexpr int kShrinkTokens = 8, kShrinkVectors = 3, kExpandTokens = 6, kExpandVectors = 4;
#else
constexpr int kShrinkTokens = 4, kShrinkVectors = 2, kExpandTokens = 3, kExpandVectors = 2;
#endif
constexpr int64_t kColumns = 256;  // output columns of an expand work item

inline float widen(float v) { return v; }
inline float widen(uint16_t v) {  // bf16 → f32, exact
  const uint32_t bits = uint32_t(v) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline vf load(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline vf load(const uint16_t* p) {
  vh h;
  std::memcpy(&h, p, sizeof h);
  return (vf)(__builtin_convertvector(h, vu) << 16);
}

inline void store(float* p, vf v) { std::memcpy(p, &v, sizeof v); }
inline void store(uint16_t* p, vf v) {  // f32 → bf16, nearest even; NaN stays NaN
  const vu bits = (vu)v;
  const vu rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
  const vu nan = (vu)((bits & 0x7fffffffu) > 0x7f800000u);
  const vh h = __builtin_convertvector((((bits >> 16) | 0x40u) & nan) | (rounded & ~nan), vh);
  std::memcpy(p, &h, sizeof h);
}

inline void narrow(float v, float* p) { *p = v; }
inline void narrow(float v, uint16_t* p) {
  vf wide = {v};
  uint16_t lanes[kLanes];
  store(lanes, wide);
  *p = lanes[0];
}

struct LoRAShapes {
  int64_t in, ranks, width, rank, x_stride, out_stride;
};

inline LoRAShapes check_lora(const at::Tensor& x, const at::Tensor& out, const at::Tensor& a,
                             const at::Tensor& b, const at::Tensor& src, const at::Tensor& starts,
                             const at::Tensor& slots, at::IntArrayRef bounds, int64_t rank,
                             at::ScalarType type) {
  for (const at::Tensor* t : {&x, &out, &a, &b})
    TORCH_CHECK(t->scalar_type() == type && t->device().is_cpu() && t->stride(-1) == 1,
                "lora_add_: x, out, a and b must be CPU tensors of the library's type, rows "
                "of unit stride");
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2 && a.dim() == 3 && b.dim() == 3,
              "lora_add_: x and out are 2-D, a and b 3-D");
  TORCH_CHECK(a.is_contiguous() && b.is_contiguous(), "lora_add_: a and b must be contiguous");
  const int64_t in = x.size(1), ranks = a.size(2), width = out.size(1);
  const int64_t modules = int64_t(bounds.size()) - 1;
  TORCH_CHECK(modules >= 1 && rank >= 1 && modules * rank == ranks && bounds[0] == 0 &&
                  bounds[modules] == width,
              "lora_add_: bounds must run from 0 to out's width, one module per rank rows");
  for (int64_t k = 0; k < modules; ++k)
    TORCH_CHECK(bounds[k] <= bounds[k + 1], "lora_add_: bounds must not decrease");
  TORCH_CHECK(a.size(1) == in && b.size(0) == a.size(0) && b.size(1) == ranks &&
                  b.size(2) == width && out.size(0) == x.size(0),
              "lora_add_: a must be [S, in, K R] and b [S, K R, width] for x and out");
  for (const at::Tensor* t : {&src, &starts, &slots})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->dim() == 1 && t->is_contiguous() &&
                    t->device().is_cpu(),
                "lora_add_: src, starts and slots must be contiguous int64 vectors");
  const int64_t groups = slots.size(0), tokens = src.size(0);
  TORCH_CHECK(starts.size(0) == groups + 1, "lora_add_: starts must hold one more than slots");
  const int64_t* start = starts.data_ptr<int64_t>();
  const int64_t* slot = slots.data_ptr<int64_t>();
  const int64_t* row = src.data_ptr<int64_t>();
  TORCH_CHECK(start[0] == 0 && start[groups] == tokens, "lora_add_: starts must cover src");
  for (int64_t g = 0; g < groups; ++g)
    TORCH_CHECK(start[g] <= start[g + 1] && slot[g] >= 0 && slot[g] < a.size(0),
                "lora_add_: starts must not decrease and slots must index a");
  for (int64_t m = 0; m < tokens; ++m)
    TORCH_CHECK(row[m] >= 0 && row[m] < x.size(0), "lora_add_: src must index x's rows");
  return {in, ranks, width, rank, x.stride(0), out.stride(0)};
}

// The smallest tile of {1, 2, 4, Most} tokens that holds n (Most: the register tile's).
template <int Most, class F>
void by_tokens(int n, F&& tile) {
  if (n <= 1) {
    tile.template operator()<1>();
  } else if (n <= 2) {
    tile.template operator()<2>();
  } else if (Most > 4 && n <= 4) {
    tile.template operator()<(Most > 4 ? 4 : Most)>();
  } else {
    tile.template operator()<Most>();
  }
}

// shrunk[m, j0 .. j0 + 16 V] = x[row] · a[:, those columns] for N `rows` (the tile's own
// rows first, then repeats of its last: only the first n are stored).
template <int N, int V, class T>
void shrink_tile(const T* x, const T* a, const int64_t* rows, int n, int64_t j0,
                 const LoRAShapes& s, float* shrunk) {
  vf acc[N][V] = {};
  for (int64_t i = 0; i < s.in; ++i) {
    vf av[V];
    for (int v = 0; v < V; ++v) av[v] = load(a + i * s.ranks + j0 + v * kLanes);
    for (int m = 0; m < N; ++m) {
      const float xv = widen(x[rows[m] * s.x_stride + i]);
      for (int v = 0; v < V; ++v) acc[m][v] += av[v] * xv;
    }
  }
  for (int m = 0; m < n; ++m)
    for (int v = 0; v < V; ++v) store(shrunk + m * s.ranks + j0 + v * kLanes, acc[m][v]);
}

// shrunk[first..last] = x[src[first..last]] · a (last - first ≤ kShrinkTokens).
template <class T>
void shrink(const T* x, const T* a, const int64_t* src, int64_t first, int64_t last,
            const LoRAShapes& s, float* shrunk) {
  const int n = int(last - first);
  int64_t rows[kShrinkTokens];
  for (int m = 0; m < kShrinkTokens; ++m) rows[m] = src[first + std::min(m, n - 1)];
  float* to = shrunk + first * s.ranks;
  int64_t j = 0;
  by_tokens<kShrinkTokens>(n, [&]<int N>() {
    for (; j + kShrinkVectors * kLanes <= s.ranks; j += kShrinkVectors * kLanes)
      shrink_tile<N, kShrinkVectors>(x, a, rows, n, j, s, to);
    for (; j + kLanes <= s.ranks; j += kLanes) shrink_tile<N, 1>(x, a, rows, n, j, s, to);
  });
  for (; j < s.ranks; ++j)  // ranks past the last whole vector
    for (int m = 0; m < n; ++m) {
      float sum = 0.0f;
      for (int64_t i = 0; i < s.in; ++i) sum += widen(x[rows[m] * s.x_stride + i]) * widen(a[i * s.ranks + j]);
      to[m * s.ranks + j] = sum;
    }
}

// out[rows, c .. c + 16 C] += t · b[rank rows of module k, those columns], for N rows
// (repeats past the first n, as shrink_tile's); `t` the tokens' rows of `shrunk` at the
// module's first rank.
template <int N, int C, class T>
void expand_tile(const T* b, const int64_t* rows, const float* const* t, int n, int64_t c,
                 const LoRAShapes& s, T* out) {
  vf acc[N][C] = {};
  for (int64_t r = 0; r < s.rank; ++r) {
    vf bv[C];
    for (int v = 0; v < C; ++v) bv[v] = load(b + r * s.width + c + v * kLanes);
    for (int m = 0; m < N; ++m)
      for (int v = 0; v < C; ++v) acc[m][v] += bv[v] * t[m][r];
  }
  for (int m = 0; m < n; ++m)
    for (int v = 0; v < C; ++v) {
      T* to = out + rows[m] * s.out_stride + c + v * kLanes;
      store(to, load(to) + acc[m][v]);
    }
}

// out[src[first..last], c0..c1] += the group's shrunk rows of module k · its block of b.
template <class T>
void expand(const T* b, const int64_t* src, int64_t first, int64_t last, int64_t k, int64_t c0,
            int64_t c1, const LoRAShapes& s, const float* shrunk, T* out) {
  const T* block = b + k * s.rank * s.width;
  for (int64_t m0 = first; m0 < last; m0 += kExpandTokens) {
    const int n = int(std::min<int64_t>(kExpandTokens, last - m0));
    int64_t rows[kExpandTokens];
    const float* t[kExpandTokens];
    for (int m = 0; m < kExpandTokens; ++m) {
      const int64_t at = m0 + std::min(m, n - 1);
      rows[m] = src[at];
      t[m] = shrunk + at * s.ranks + k * s.rank;
    }
    int64_t c = c0;
    by_tokens<kExpandTokens>(n, [&]<int N>() {
      for (; c + kExpandVectors * kLanes <= c1; c += kExpandVectors * kLanes)
        expand_tile<N, kExpandVectors>(block, rows, t, n, c, s, out);
      for (; c + kLanes <= c1; c += kLanes) expand_tile<N, 1>(block, rows, t, n, c, s, out);
    });
    for (; c < c1; ++c)  // columns past the last whole vector
      for (int m = 0; m < n; ++m) {
        float sum = 0.0f;
        for (int64_t r = 0; r < s.rank; ++r) sum += t[m][r] * widen(block[r * s.width + c]);
        T* to = out + rows[m] * s.out_stride + c;
        narrow(widen(*to) + sum, to);
      }
  }
}

// T: float, or uint16_t holding bf16.
template <class T>
void lora_add_(const at::Tensor& x, at::Tensor& out, const at::Tensor& a, const at::Tensor& b,
               const at::Tensor& src, const at::Tensor& starts, const at::Tensor& slots,
               at::IntArrayRef bounds, int64_t rank, at::ScalarType type) {
  const LoRAShapes s = check_lora(x, out, a, b, src, starts, slots, bounds, rank, type);
  const int64_t groups = slots.size(0);
  const int64_t* start = starts.data_ptr<int64_t>();
  const int64_t* slot = slots.data_ptr<int64_t>();
  const int64_t* row = src.data_ptr<int64_t>();
  const T* xp = static_cast<const T*>(x.data_ptr());
  const T* ap = static_cast<const T*>(a.data_ptr());
  const T* bp = static_cast<const T*>(b.data_ptr());
  T* op = static_cast<T*>(out.data_ptr());
  std::vector<float> shrunk(src.size(0) * s.ranks);
  std::vector<int64_t> items;  // shrink: (group, first token)
  for (int64_t g = 0; g < groups; ++g)
    for (int64_t m = start[g]; m < start[g + 1]; m += kShrinkTokens) items.insert(items.end(), {g, m});
  at::parallel_for(0, int64_t(items.size() / 2), 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t g = items[2 * i], m = items[2 * i + 1];
      shrink(xp, ap + slot[g] * s.in * s.ranks, row, m, std::min(m + kShrinkTokens, start[g + 1]), s,
             shrunk.data());
    }
  });
  items.clear();  // expand: (group, module, first column)
  for (int64_t g = 0; g < groups; ++g)
    for (int64_t k = 0; k + 1 < int64_t(bounds.size()); ++k)
      for (int64_t c = bounds[k]; c < bounds[k + 1]; c += kColumns) items.insert(items.end(), {g, k, c});
  at::parallel_for(0, int64_t(items.size() / 3), 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t g = items[3 * i], k = items[3 * i + 1], c = items[3 * i + 2];
      expand(bp + slot[g] * s.ranks * s.width, row, start[g], start[g + 1], k, c,
             std::min(c + kColumns, bounds[k + 1]), s, shrunk.data(), op);
    }
  });
}

inline void define_lora(torch::Library& m) {
  m.def("lora_add_(Tensor x, Tensor(a!) out, Tensor a, Tensor b, Tensor src, Tensor starts, "
        "Tensor slots, int[] bounds, int rank) -> ()");
}

}  // namespace
}  // namespace blockserve_cpu::lora
