// Linear layers on AMX tiles: y = x · Wᵀ (+ bias), bfloat16 in and out, float32 sums; and
// the MLP's gate/up product with SiLU(gate) · up applied as its results leave the tiles.
//
// A decode step's products read every weight of the model once for a few dozen rows: they
// are bound by memory, and oneDNN's read the weights at 12-18 GB/s where a plain read
// reached 25-33 on the host measured (docs/benchmarks.md, "Decode products on AMX tiles").
// Here the weight is repacked once into tile order, [N/16][K/32][16 pairs of k][16
// columns][2], so that each B tile (16 columns × 32 k) is one contiguous kilobyte and a
// thread's share of the weight one sequential stream, fetched into L2 a few tiles ahead.
// Each task takes two 16-column blocks (tasks.h): per 32 of k, two A tiles (32 rows of x,
// read where x lies, a last partial tile from a zero-padded copy) and two B tiles make four
// tile products into four 16×16 float32 results, so each loaded tile serves two products.
// Rows past 32 take further passes over the same columns, whose tiles are then in cache: 32
// rows a pass, the last 16 or fewer in a pass of one row tile (33 rows cost 48 rows'
// products, not 64). The next step's tiles are loaded while this one's last products run.
//
// A prefill's x is larger than L2 (2,048 rows of 576 are 2.3 MB): its rows are cut into
// chunks of at most kChunkBytes, as many as a multiple of the threads, and a task is one
// chunk's rows against one pair of blocks, numbered chunk by chunk: each thread starts on
// chunks of its own, keeps them in its own cache while the weight streams past, and reads the
// rows the layer's previous operator wrote on the same core (it split the rows the same way).
//
// The fused gate/up product pairs gate block j with up block j + n/32 in a task, rounds both
// to bf16 as the unfused product would, and writes bf16(bf16(silu(gate)) · up): the same bits
// as tile_linear followed by silu_and_mul (layer_ops_bf16.cpp), without writing and reading
// back the [rows, n] product between them.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <utility>

#include "amx.h"
#include "bf16.h"
#include "tasks.h"

namespace {

using namespace blockserve_cpu;

constexpr int64_t kTileK = 32;                 // bf16 of k per tile row
constexpr int64_t kTileElems = 16 * kTileK;    // one 1 KB tile
constexpr int64_t kColumnBlock = 32;           // output columns per task: two B tiles
constexpr int64_t kChunkBytes = 512 * 1024;    // the most of x a task's rows span
constexpr int64_t kPrefetchBytes = 32 * 1024;  // how far ahead of its products a stream is fetched

// W [N, K] row-major → tile order: B tile (n block b, k step s) at (b · K/32 + s) · 512, its
// row p holding (W[n][32s + 2p], W[n][32s + 2p + 1]) for the block's 16 columns n.
at::Tensor tile_pack(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16,
              "tile_pack: the weight must be 2-D bfloat16");
  const int64_t n = weight.size(0), k = weight.size(1);
  TORCH_CHECK(n % kColumnBlock == 0 && k % kTileK == 0, "tile_pack: [", n, ", ", k,
              "] is not a multiple of [32, 32]");
  const at::Tensor w = weight.contiguous();
  at::Tensor packed = at::empty_like(w);
  const auto* src = reinterpret_cast<const uint16_t*>(w.data_ptr());
  auto* dst = reinterpret_cast<uint16_t*>(packed.data_ptr());
  const int64_t steps = k / kTileK;
  at::parallel_for(0, n / 16, 1, [&](int64_t begin, int64_t end) {
    for (int64_t block = begin; block < end; ++block) {
      uint16_t* out = dst + block * steps * kTileElems;
      for (int64_t s = 0; s < steps; ++s)
        for (int64_t p = 0; p < 16; ++p)
          for (int64_t c = 0; c < 16; ++c) {
            const uint16_t* row = src + (block * 16 + c) * k + s * kTileK + 2 * p;
            *out++ = row[0];
            *out++ = row[1];
          }
    }
  });
  return packed;
}

// One row tile of x: 16 rows of k values, `stride` bytes apart.
struct RowTile {
  const uint16_t* rows;
  int64_t stride;
};

// RowTiles tiles of x's rows (x0, then x1) times the 32 columns whose tiles start at b0 (b1 =
// the next 16 columns), k deep: four (or two) 16×16 float32 results into acc. Tiles 0-3 hold
// the results (0, 1: x0's rows; 2, 3: x1's), 4-5 x, 6-7 W.
template <int RowTiles>
void tile_block(RowTile x0, RowTile x1, int64_t k, const uint16_t* b0, const uint16_t* b1,
                bool prefetch, float (*acc)[16][16]) {
  const int64_t steps = k / kTileK;
  _tile_zero(0);
  _tile_zero(1);
  if constexpr (RowTiles == 2) {
    _tile_zero(2);
    _tile_zero(3);
  }
  _tile_loadd(4, x0.rows, x0.stride);
  _tile_loadd(6, b0, 64);
  _tile_loadd(7, b1, 64);
  if constexpr (RowTiles == 2) _tile_loadd(5, x1.rows, x1.stride);
  for (int64_t s = 0; s < steps; ++s) {
    if (prefetch) {
      const char* ahead0 = reinterpret_cast<const char*>(b0 + s * kTileElems) + kPrefetchBytes;
      const char* ahead1 = reinterpret_cast<const char*>(b1 + s * kTileElems) + kPrefetchBytes;
      for (int line = 0; line < 1024; line += 64) {
        _mm_prefetch(ahead0 + line, _MM_HINT_T1);
        _mm_prefetch(ahead1 + line, _MM_HINT_T1);
      }
    }
    const bool more = s + 1 < steps;
    const int64_t next = (s + 1) * kTileElems;
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (RowTiles == 2) _tile_dpbf16ps(2, 5, 6);
    if (more) _tile_loadd(6, b0 + next, 64);
    _tile_dpbf16ps(1, 4, 7);
    if (more) _tile_loadd(4, x0.rows + (s + 1) * kTileK, x0.stride);
    if constexpr (RowTiles == 2) _tile_dpbf16ps(3, 5, 7);
    if (more) {
      _tile_loadd(7, b1 + next, 64);
      if constexpr (RowTiles == 2) _tile_loadd(5, x1.rows + (s + 1) * kTileK, x1.stride);
    }
  }
  _tile_stored(0, acc[0], 64);
  _tile_stored(1, acc[1], 64);
  if constexpr (RowTiles == 2) {
    _tile_stored(2, acc[2], 64);
    _tile_stored(3, acc[3], 64);
  }
}

// The checks both products make of x and the packed weight [n, k].
void check_operands(const char* name, const at::Tensor& x, const at::Tensor& packed) {
  TORCH_CHECK(tiles_available(), name, ": this CPU (or process) has no AMX-BF16 tiles");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 &&
                  packed.scalar_type() == at::kBFloat16 && packed.dim() == 2,
              name, ": x [rows, k] and the packed weight [n, k] must be bfloat16");
  const int64_t k = x.size(1), n = packed.size(0);
  TORCH_CHECK(packed.size(1) == k && packed.is_contiguous(), name, ": x has ", k,
              " columns, the weight ", packed.size(1));
  TORCH_CHECK(n % kColumnBlock == 0 && k % kTileK == 0, name, ": [", n, ", ", k,
              "] is not a multiple of [32, 32]");
}

// x's rows times `tasks` pairs of 16-column blocks of a packed weight (blocks(task): the
// pair's first tiles); each row's float32 sums handed to store(row, task, first, second),
// its 16 sums against each block of the pair.
template <typename Blocks, typename Store>
void tile_passes(const at::Tensor& x, int64_t tasks, const Blocks& blocks, const Store& store) {
  const int64_t rows = x.size(0), k = x.size(1);
  // Whole tiles of rows, 16 each, read where x lies; the rows of a last partial tile are
  // copied into a tile padded with zero rows.
  const int64_t padded = (rows + 15) / 16 * 16, whole = rows / 16 * 16;
  const at::Tensor left = x.stride(1) == 1 ? x : x.contiguous();
  const auto* xs = reinterpret_cast<const uint16_t*>(left.data_ptr());
  at::Tensor tail;
  if (padded != rows) {
    tail = at::empty({16, k}, x.options());
    auto* tp = reinterpret_cast<uint16_t*>(tail.data_ptr());
    const size_t row_bytes = k * sizeof(uint16_t);
    for (int64_t r = 0; r < 16; ++r)
      if (whole + r < rows)
        std::memcpy(tp + r * k, xs + (whole + r) * left.stride(0), row_bytes);
      else
        std::memset(tp + r * k, 0, row_bytes);
  }
  const int64_t x_stride = left.stride(0) * static_cast<int64_t>(sizeof(uint16_t));
  const auto row_tile = [&](int64_t row0) {
    return row0 < whole ? RowTile{xs + row0 * left.stride(0), x_stride}
                        : RowTile{reinterpret_cast<const uint16_t*>(tail.data_ptr()),
                                  k * static_cast<int64_t>(sizeof(uint16_t))};
  };
  // Chunks of rows (a multiple of 32 each) no larger than kChunkBytes of x, as many as a
  // multiple of the threads where there is more than one, so that each thread has its own.
  const int64_t threads = at::get_num_threads();
  int64_t chunks = (rows * k * static_cast<int64_t>(sizeof(uint16_t)) + kChunkBytes - 1) /
                   kChunkBytes;
  if (chunks > 1) chunks = (chunks + threads - 1) / threads * threads;
  const int64_t chunk_rows = ((padded + chunks - 1) / chunks + 31) / 32 * 32;
  chunks = (padded + chunk_rows - 1) / chunk_rows;
  parallel_tasks<TileScope>(chunks * tasks, [&](int64_t index) {
    alignas(64) float acc[4][16][16];
    const int64_t task = index % tasks, first_row = index / tasks * chunk_rows;
    const int64_t end_row = std::min(padded, first_row + chunk_rows);
    const auto [b0, b1] = blocks(task);
    for (int64_t row0 = first_row; row0 < end_row; row0 += 32) {
      const bool first = row0 == first_row;  // later passes find the tiles in cache
      if (end_row - row0 == 16)  // one row tile left
        tile_block<1>(row_tile(row0), {}, k, b0, b1, first, acc);
      else
        tile_block<2>(row_tile(row0), row_tile(row0 + 16), k, b0, b1, first, acc);
      for (int64_t r = 0; r < 32 && row0 + r < rows; ++r)
        store(row0 + r, task, acc[(r / 16) * 2][r % 16], acc[(r / 16) * 2 + 1][r % 16]);
    }
  });
}

at::Tensor tile_linear(const at::Tensor& x, const at::Tensor& packed,
                       const std::optional<at::Tensor>& bias) {
  check_operands("tile_linear", x, packed);
  const int64_t rows = x.size(0), k = x.size(1), n = packed.size(0);
  TORCH_CHECK(!bias || (bias->dim() == 1 && bias->size(0) == n), "tile_linear: bias must be [",
              n, "]");
  at::Tensor out = at::empty({rows, n}, x.options());
  if (rows == 0) return out;
  const at::Tensor bias_f32 = bias ? bias->to(at::kFloat).contiguous() : at::Tensor();
  const auto* ws = reinterpret_cast<const uint16_t*>(packed.data_ptr());
  const float* bs = bias ? bias_f32.data_ptr<float>() : nullptr;
  auto* ys = reinterpret_cast<uint16_t*>(out.data_ptr());
  const int64_t block_elems = k / kTileK * kTileElems;  // one 16-column block of W
  const auto blocks = [&](int64_t task) {  // columns 32 task .. 32 task + 31
    const uint16_t* b0 = ws + 2 * task * block_elems;
    return std::pair{b0, b0 + block_elems};
  };
  const auto store = [&](int64_t row, int64_t task, const float* first, const float* second) {
    uint16_t* y = ys + row * n + task * kColumnBlock;
    const float* sums[2] = {first, second};
    for (int64_t half = 0; half < 2; ++half) {
      __m512 v = _mm512_load_ps(sums[half]);
      if (bs) v = _mm512_add_ps(v, _mm512_loadu_ps(bs + task * kColumnBlock + half * 16));
      store_bf16(y + half * 16, v);
    }
  };
  tile_passes(x, n / kColumnBlock, blocks, store);
  return out;
}

// silu(gate) · up of the product x · Wᵀ, W = [gate; up] (n rows, gate's n/2 first).
at::Tensor tile_linear_silu(const at::Tensor& x, const at::Tensor& packed) {
  check_operands("tile_linear_silu", x, packed);
  const int64_t rows = x.size(0), k = x.size(1), width = packed.size(0) / 2;
  at::Tensor out = at::empty({rows, width}, x.options());
  if (rows == 0) return out;
  const auto* ws = reinterpret_cast<const uint16_t*>(packed.data_ptr());
  auto* ys = reinterpret_cast<uint16_t*>(out.data_ptr());
  const int64_t block_elems = k / kTileK * kTileElems;
  const int64_t up_blocks = width / 16 * block_elems;  // from a gate block to its up block
  const auto blocks = [&](int64_t task) {  // gate and up columns 16 task .. 16 task + 15
    const uint16_t* gate = ws + task * block_elems;
    return std::pair{gate, gate + up_blocks};
  };
  const auto store = [&](int64_t row, int64_t task, const float* gate, const float* up) {
    store_bf16(ys + row * width + task * 16,
               silu_mul_sums(_mm512_load_ps(gate), _mm512_load_ps(up)));
  };
  tile_passes(x, width / 16, blocks, store);
  return out;
}

bool has_amx() { return tiles_available(); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(blockserve_cpu, m) {
  m.def("tile_pack(Tensor weight) -> Tensor");
  m.def("tile_linear(Tensor x, Tensor packed, Tensor? bias) -> Tensor");
  m.def("tile_linear_silu(Tensor x, Tensor packed) -> Tensor");
  m.def("has_amx() -> bool", &has_amx);
}

TORCH_LIBRARY_IMPL(blockserve_cpu, CPU, m) {
  m.impl("tile_pack", &tile_pack);
  m.impl("tile_linear", &tile_linear);
  m.impl("tile_linear_silu", &tile_linear_silu);
}
