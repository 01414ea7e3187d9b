// blockserve CUDA kernels: write K/V into the paged cache, and paged decode attention.
//
// Plain CUDA (no torch headers), so `nvcc --ptx` checks them anywhere; bindings.cpp wraps the
// launchers for torch. KV cache layout per layer, as in attention/metadata.py:
//   key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_dim], contiguous.
//
// Kernels are launched through BLOCKSERVE_LAUNCH so that the tests can also run this file on
// the CPU (tests/attention/cuda_emulation: each CUDA thread a fiber, barriers and warp
// shuffles scheduled like the hardware's); built by nvcc it is an ordinary <<<>>> launch.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "kernels.h"

#ifdef BLOCKSERVE_CPU_EMULATION
#include "emulate.h"
#define BLOCKSERVE_LAUNCH(kernel, grid, block, stream, ...) \
  ::emulate::launch(grid, block, [&] { kernel(__VA_ARGS__); })
#else
#define BLOCKSERVE_LAUNCH(kernel, grid, block, stream, ...) \
  kernel<<<grid, block, 0, stream>>>(__VA_ARGS__)
#endif

namespace blockserve {

constexpr int kWarpSize = 32;
constexpr int kDecodeWarps = 4;
constexpr int kTokensPerStep = 8;  // keys a warp loads before it computes on them
constexpr int kMaxDecodeSplits = 32;

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16(x);
}

// DIMS consecutive elements read as one aligned vector (8 or 16 bytes for DIMS = 4).
template <typename T, int DIMS>
struct alignas(sizeof(T) * DIMS) Vec {
  T v[DIMS];
};

template <typename T, int DIMS>
__device__ __forceinline__ Vec<T, DIMS> load_vec(const T* src) {
  return *reinterpret_cast<const Vec<T, DIMS>*>(src);
}

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int mask = kWarpSize / 2; mask > 0; mask >>= 1) x += __shfl_xor_sync(0xffffffffu, x, mask);
  return x;
}

// The float32 scratch of a split decode, carved from one buffer of
// paged_decode_workspace_floats(): per (split, sequence, query head) an unnormalised output row,
// the running max and the running total. Indexed [split][sequence][head].
struct SplitWorkspace {
  float* out;
  float* max;
  float* total;
  int64_t num_seqs;
  int64_t num_heads;

  __device__ SplitWorkspace(float* base, unsigned seqs, const DecodeShape& shape)
      : num_seqs(seqs), num_heads(static_cast<int64_t>(shape.num_kv_heads) * shape.queries_per_kv) {
    const int64_t stats = shape.num_splits * num_seqs * num_heads;
    out = base;
    max = base + stats * shape.head_dim;
    total = max + stats;
  }
  __device__ int64_t stat(int split, int seq, int head) const {
    return (split * num_seqs + seq) * num_heads + head;
  }
};

// One CUDA block per token: copy its [num_kv_heads * head_dim] row of K and of V to its slot.
template <typename T>
__global__ void reshape_and_cache_kernel(const T* __restrict__ key, const T* __restrict__ value,
                                         T* __restrict__ key_cache, T* __restrict__ value_cache,
                                         const int64_t* __restrict__ slot_mapping,
                                         int64_t key_stride, int64_t value_stride, int row) {
  const int64_t token = blockIdx.x;
  const int64_t slot = slot_mapping[token];
  if (slot < 0) return;  // a padding token writes nothing
  T* key_dst = key_cache + slot * row;  // [block, offset] flattens to slot for this layout
  T* value_dst = value_cache + slot * row;
  for (int i = threadIdx.x; i < row; i += blockDim.x) {
    key_dst[i] = key[token * key_stride + i];
    value_dst[i] = value[token * value_stride + i];
  }
}

// Paged decode attention, one CUDA block per (sequence, group of up to GROUP query heads
// sharing one KV head), kDecodeWarps warps. Each warp takes every kDecodeWarps-th run of
// kTokensPerStep keys; a key's head_dim elements are spread over the warp's lanes (DIMS each,
// one vector load), so a warp reads whole contiguous K and V rows, and every row is read once
// for all the group's query heads. Each warp keeps an online softmax (running max, sum and
// output, float32) per head; at the end the warps' partial results are merged through shared
// memory. Nothing grows with the context: any length runs in the same shared memory.
// head_dim = kWarpSize * DIMS, or head_dim <= kWarpSize with DIMS = 1 (lanes past it idle).
// Keys and values stay in their storage type in registers until used (half the registers of
// float32 for 16-bit caches).
template <typename T, int DIMS, int GROUP>
__global__ void __launch_bounds__(kDecodeWarps* kWarpSize)
    paged_decode_kernel(T* __restrict__ out, const T* __restrict__ query,
                        const T* __restrict__ key_cache, const T* __restrict__ value_cache,
                        const int64_t* __restrict__ block_tables,
                        const int64_t* __restrict__ seq_lens, DecodeShape shape,
                        float* __restrict__ workspace) {
  constexpr int kLaneDims = kWarpSize * DIMS;
  __shared__ float warp_max[kDecodeWarps][GROUP];
  __shared__ float warp_total[kDecodeWarps][GROUP];
  __shared__ float warp_out[kDecodeWarps][GROUP][kLaneDims];

  const int seq = blockIdx.x;
  const int groups_per_kv = (shape.queries_per_kv + GROUP - 1) / GROUP;
  const int kv_head = blockIdx.y / groups_per_kv;
  const int group_start = (blockIdx.y % groups_per_kv) * GROUP;
  const int first_head = kv_head * shape.queries_per_kv + group_start;
  const int heads = shape.queries_per_kv - group_start < GROUP
                        ? shape.queries_per_kv - group_start
                        : GROUP;
  const int warp = threadIdx.x / kWarpSize;
  const int lane = threadIdx.x % kWarpSize;
  const int dim0 = lane * DIMS;
  const bool lane_active = dim0 < shape.head_dim;
  const int64_t seq_len = seq_lens[seq];
  const int64_t row = static_cast<int64_t>(shape.num_kv_heads) * shape.head_dim;

  float q[GROUP][DIMS];
  float running_max[GROUP];
  float running_total[GROUP];
  float acc[GROUP][DIMS];
#pragma unroll
  for (int h = 0; h < GROUP; ++h) {
    running_max[h] = -INFINITY;
    running_total[h] = 0.f;
#pragma unroll
    for (int i = 0; i < DIMS; ++i) {
      q[h][i] = 0.f;
      acc[h][i] = 0.f;
    }
    if (h < heads && lane_active) {
      const Vec<T, DIMS> vec = load_vec<T, DIMS>(
          query + seq * shape.query_stride + (first_head + h) * shape.head_dim + dim0);
#pragma unroll
      for (int i = 0; i < DIMS; ++i) q[h][i] = to_float(vec.v[i]) * shape.scale;
    }
  }

  // This block's split of the context: a contiguous run of steps (all of them if unsplit).
  const int64_t num_steps = (seq_len + kTokensPerStep - 1) / kTokensPerStep;
  const int64_t steps_per_split = (num_steps + shape.num_splits - 1) / shape.num_splits;
  const int64_t step_begin = blockIdx.z * steps_per_split;
  const int64_t step_end =
      step_begin + steps_per_split < num_steps ? step_begin + steps_per_split : num_steps;
  for (int64_t step = step_begin + warp; step < step_end; step += kDecodeWarps) {
    const int64_t first = step * kTokensPerStep;  // a step never crosses a cache block
    const int64_t block = block_tables[seq * shape.max_blocks + first / shape.block_size];
    const int64_t base = (block * shape.block_size + first % shape.block_size) * row +
                         static_cast<int64_t>(kv_head) * shape.head_dim + dim0;
    const int64_t remaining = seq_len - first;
    const int tokens = remaining < kTokensPerStep ? static_cast<int>(remaining) : kTokensPerStep;
    Vec<T, DIMS> k[kTokensPerStep];
    Vec<T, DIMS> v[kTokensPerStep];
#pragma unroll
    for (int t = 0; t < kTokensPerStep; ++t) {
      if (t < tokens && lane_active) {
        k[t] = load_vec<T, DIMS>(key_cache + base + t * row);
        v[t] = load_vec<T, DIMS>(value_cache + base + t * row);
      } else {
#pragma unroll
        for (int i = 0; i < DIMS; ++i) k[t].v[i] = v[t].v[i] = from_float<T>(0.f);
      }
    }
#pragma unroll
    for (int t = 0; t < kTokensPerStep; ++t) {
      if (t >= tokens) break;  // the same for the whole warp
#pragma unroll
      for (int h = 0; h < GROUP; ++h) {
        if (h >= heads) break;
        float partial = 0.f;
#pragma unroll
        for (int i = 0; i < DIMS; ++i) partial += q[h][i] * to_float(k[t].v[i]);
        const float score = warp_sum(partial);
        const float new_max = fmaxf(running_max[h], score);
        const float correction = __expf(running_max[h] - new_max);  // 0 while the max was -inf
        const float weight = __expf(score - new_max);
        running_total[h] = running_total[h] * correction + weight;
#pragma unroll
        for (int i = 0; i < DIMS; ++i) {
          acc[h][i] = acc[h][i] * correction + weight * to_float(v[t].v[i]);
        }
        running_max[h] = new_max;
      }
    }
  }

  // A warp that saw no key leaves max -inf and total 0: it weighs nothing in the merge. (In an
  // unsplit launch warp 0 always saw key 0; a split can be empty, and then so is its result.)
  for (int h = 0; h < heads; ++h) {
    if (lane == 0) {
      warp_max[warp][h] = running_max[h];
      warp_total[warp][h] = running_total[h];
    }
#pragma unroll
    for (int i = 0; i < DIMS; ++i) warp_out[warp][h][dim0 + i] = acc[h][i];
  }
  __syncthreads();
  for (int index = threadIdx.x; index < heads * shape.head_dim; index += blockDim.x) {
    const int h = index / shape.head_dim;
    const int d = index % shape.head_dim;
    float overall_max = -INFINITY;
    for (int w = 0; w < kDecodeWarps; ++w) overall_max = fmaxf(overall_max, warp_max[w][h]);
    float total = 0.f;
    float result = 0.f;
    for (int w = 0; w < kDecodeWarps; ++w) {
      if (warp_max[w][h] == -INFINITY) continue;  // (also keeps an empty split free of NaN)
      const float factor = __expf(warp_max[w][h] - overall_max);
      total += warp_total[w][h] * factor;
      result += warp_out[w][h][d] * factor;
    }
    if (shape.num_splits == 1) {
      out[seq * shape.out_stride + (first_head + h) * shape.head_dim + d] =
          from_float<T>(result / total);
    } else {  // unnormalised, for merge_decode_splits_kernel
      const SplitWorkspace split{workspace, gridDim.x, shape};
      const int64_t stat = split.stat(blockIdx.z, seq, first_head + h);
      split.out[stat * shape.head_dim + d] = result;
      if (d == 0) {
        split.max[stat] = overall_max;
        split.total[stat] = total;
      }
    }
  }
}

// Combine the splits of each (sequence, query head): weights exp(split max - overall max).
// Split 0 holds key 0, so the overall max is finite; an empty split (max -inf, total and output
// 0) weighs 0.
template <typename T>
__global__ void merge_decode_splits_kernel(T* __restrict__ out,
                                           const float* __restrict__ workspace,
                                           DecodeShape shape) {
  const int seq = blockIdx.x;
  const int head = blockIdx.y;
  const SplitWorkspace split{const_cast<float*>(workspace), gridDim.x, shape};
  float overall_max = -INFINITY;
  for (int z = 0; z < shape.num_splits; ++z) {
    overall_max = fmaxf(overall_max, split.max[split.stat(z, seq, head)]);
  }
  for (int d = threadIdx.x; d < shape.head_dim; d += blockDim.x) {
    float total = 0.f;
    float result = 0.f;
    for (int z = 0; z < shape.num_splits; ++z) {
      const int64_t stat = split.stat(z, seq, head);
      const float factor = __expf(split.max[stat] - overall_max);  // empty split: exp(-inf) = 0
      total += split.total[stat] * factor;
      result += split.out[stat * shape.head_dim + d] * factor;
    }
    out[seq * shape.out_stride + head * shape.head_dim + d] = from_float<T>(result / total);
  }
}

template <typename T>
static void launch_reshape_and_cache(const void* key, const void* value, void* key_cache,
                                     void* value_cache, const int64_t* slot_mapping,
                                     int64_t num_tokens, int64_t key_stride,
                                     int64_t value_stride, int row, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(num_tokens));
  const dim3 block(row < 1024 ? row : 1024);
  BLOCKSERVE_LAUNCH(reshape_and_cache_kernel<T>, grid, block, stream, static_cast<const T*>(key),
                    static_cast<const T*>(value), static_cast<T*>(key_cache),
                    static_cast<T*>(value_cache), slot_mapping, key_stride, value_stride, row);
}

template <typename T, int DIMS>
static void launch_paged_decode(void* out, const void* query, const void* key_cache,
                                const void* value_cache, const int64_t* block_tables,
                                const int64_t* seq_lens, int num_seqs, const DecodeShape& shape,
                                float* workspace, cudaStream_t stream) {
  // Registers hold GROUP queries and outputs: 4 covers most models (GQA up to 4:1); larger
  // groups take 8 heads per block, and a block per 8 heads beyond that.
  const int group = shape.queries_per_kv <= 4 ? 4 : 8;
  const int groups_per_kv = (shape.queries_per_kv + group - 1) / group;
  const dim3 grid(num_seqs, shape.num_kv_heads * groups_per_kv, shape.num_splits);
  const dim3 block(kDecodeWarps * kWarpSize);
  // (through a pointer: a macro argument cannot hold "T, DIMS, 4")
  auto* kernel = group == 4 ? paged_decode_kernel<T, DIMS, 4> : paged_decode_kernel<T, DIMS, 8>;
  BLOCKSERVE_LAUNCH(kernel, grid, block, stream, static_cast<T*>(out),
                    static_cast<const T*>(query), static_cast<const T*>(key_cache),
                    static_cast<const T*>(value_cache), block_tables, seq_lens, shape, workspace);
  if (shape.num_splits > 1) {
    const dim3 merge_grid(num_seqs, shape.num_kv_heads * shape.queries_per_kv);
    const dim3 merge_block(shape.head_dim < 128 ? kWarpSize : 128);
    BLOCKSERVE_LAUNCH(merge_decode_splits_kernel<T>, merge_grid, merge_block, stream,
                      static_cast<T*>(out), workspace, shape);
  }
}

template <typename T>
static int dispatch_paged_decode(void* out, const void* query, const void* key_cache,
                                 const void* value_cache, const int64_t* block_tables,
                                 const int64_t* seq_lens, int num_seqs, const DecodeShape& shape,
                                 float* workspace, cudaStream_t stream) {
  switch (shape.head_dim) {
    case 256:
      launch_paged_decode<T, 8>(out, query, key_cache, value_cache, block_tables, seq_lens,
                                num_seqs, shape, workspace, stream);
      return 0;
    case 128:
      launch_paged_decode<T, 4>(out, query, key_cache, value_cache, block_tables, seq_lens,
                                num_seqs, shape, workspace, stream);
      return 0;
    case 64:
      launch_paged_decode<T, 2>(out, query, key_cache, value_cache, block_tables, seq_lens,
                                num_seqs, shape, workspace, stream);
      return 0;
    default:
      if (shape.head_dim > kWarpSize) return static_cast<int>(cudaErrorInvalidValue);
      launch_paged_decode<T, 1>(out, query, key_cache, value_cache, block_tables, seq_lens,
                                num_seqs, shape, workspace, stream);
      return 0;
  }
}

bool paged_decode_supports(const DecodeShape& shape) {
  const bool head_dim_ok = shape.head_dim == 64 || shape.head_dim == 128 ||
                           shape.head_dim == 256 || (shape.head_dim > 0 && shape.head_dim <= 32);
  return head_dim_ok && shape.block_size % kTokensPerStep == 0 && shape.num_splits >= 1;
}

int paged_decode_splits(int num_seqs, const DecodeShape& shape, int64_t max_seq_len,
                        int multiprocessors) {
  const int groups_per_kv = shape.queries_per_kv <= 4 ? 1 : (shape.queries_per_kv + 7) / 8;
  const int64_t blocks = static_cast<int64_t>(num_seqs) * shape.num_kv_heads * groups_per_kv;
  const int64_t wanted = (2 * static_cast<int64_t>(multiprocessors) + blocks - 1) / blocks;
  // Each split keeps every warp at least two steps of keys.
  const int64_t longest = max_seq_len / (2 * kDecodeWarps * kTokensPerStep);
  int64_t splits = wanted < kMaxDecodeSplits ? wanted : kMaxDecodeSplits;
  splits = splits < longest ? splits : longest;
  return splits < 1 ? 1 : static_cast<int>(splits);
}

size_t paged_decode_workspace_floats(int num_seqs, const DecodeShape& shape) {
  if (shape.num_splits <= 1) return 0;
  const size_t stats = static_cast<size_t>(shape.num_splits) * num_seqs * shape.num_kv_heads *
                       shape.queries_per_kv;
  return stats * (shape.head_dim + 2);
}

int reshape_and_cache(DType dtype, const void* key, const void* value, void* key_cache,
                      void* value_cache, const int64_t* slot_mapping, int64_t num_tokens,
                      int64_t key_stride, int64_t value_stride, int row, cudaStream_t stream) {
  switch (dtype) {
    case DType::kFloat32:
      launch_reshape_and_cache<float>(key, value, key_cache, value_cache, slot_mapping,
                                      num_tokens, key_stride, value_stride, row, stream);
      break;
    case DType::kFloat16:
      launch_reshape_and_cache<__half>(key, value, key_cache, value_cache, slot_mapping,
                                       num_tokens, key_stride, value_stride, row, stream);
      break;
    case DType::kBFloat16:
      launch_reshape_and_cache<__nv_bfloat16>(key, value, key_cache, value_cache, slot_mapping,
                                              num_tokens, key_stride, value_stride, row, stream);
      break;
  }
  return static_cast<int>(cudaGetLastError());
}

int paged_decode(DType dtype, void* out, const void* query, const void* key_cache,
                 const void* value_cache, const int64_t* block_tables, const int64_t* seq_lens,
                 int num_seqs, const DecodeShape& shape, float* workspace, cudaStream_t stream) {
  if (!paged_decode_supports(shape) || (shape.num_splits > 1 && workspace == nullptr)) {
    return static_cast<int>(cudaErrorInvalidValue);
  }
  int error = 0;
  switch (dtype) {
    case DType::kFloat32:
      error = dispatch_paged_decode<float>(out, query, key_cache, value_cache, block_tables,
                                           seq_lens, num_seqs, shape, workspace, stream);
      break;
    case DType::kFloat16:
      error = dispatch_paged_decode<__half>(out, query, key_cache, value_cache, block_tables,
                                            seq_lens, num_seqs, shape, workspace, stream);
      break;
    case DType::kBFloat16:
      error = dispatch_paged_decode<__nv_bfloat16>(out, query, key_cache, value_cache,
                                                   block_tables, seq_lens, num_seqs, shape,
                                                   workspace, stream);
      break;
  }
  return error != 0 ? error : static_cast<int>(cudaGetLastError());
}

}  // namespace blockserve
