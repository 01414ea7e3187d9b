// blockserve CUDA kernels: write K/V into the paged cache, and paged decode attention.
//
// Plain CUDA (no torch headers), so `nvcc --ptx` checks them anywhere; bindings.cpp wraps the
// launchers for torch. KV cache layout per layer, as in attention/metadata.py:
//   key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_dim], contiguous.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "kernels.h"

namespace blockserve {

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16(x);
}

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

// Block-wide reductions over blockDim.x threads through shared scratch of that size.
__device__ float block_max(float value, float* scratch) {
  scratch[threadIdx.x] = value;
  __syncthreads();
  for (int stride = blockDim.x / 2; stride > 0; stride >>= 1) {
    if (threadIdx.x < stride) scratch[threadIdx.x] = fmaxf(scratch[threadIdx.x], scratch[threadIdx.x + stride]);
    __syncthreads();
  }
  float result = scratch[0];
  __syncthreads();
  return result;
}

__device__ float block_sum(float value, float* scratch) {
  scratch[threadIdx.x] = value;
  __syncthreads();
  for (int stride = blockDim.x / 2; stride > 0; stride >>= 1) {
    if (threadIdx.x < stride) scratch[threadIdx.x] += scratch[threadIdx.x + stride];
    __syncthreads();
  }
  float result = scratch[0];
  __syncthreads();
  return result;
}

// One CUDA block per (sequence, query head): the query's scores over the whole context in
// shared memory (float32), softmax, then each thread accumulates some output dimensions.
// Shared memory: head_dim + context + blockDim.x floats.
template <typename T>
__global__ void paged_decode_kernel(T* __restrict__ out, const T* __restrict__ query,
                                    const T* __restrict__ key_cache,
                                    const T* __restrict__ value_cache,
                                    const int64_t* __restrict__ block_tables,
                                    const int64_t* __restrict__ seq_lens, DecodeShape shape) {
  extern __shared__ float shared[];
  float* q = shared;                           // [head_dim]
  float* logits = shared + shape.head_dim;     // [max_context]
  float* scratch = logits + shape.max_context; // [blockDim.x]
  const int seq = blockIdx.x;
  const int head = blockIdx.y;
  const int kv_head = head / shape.queries_per_kv;
  const int64_t seq_len = seq_lens[seq];
  const int64_t row = static_cast<int64_t>(shape.num_kv_heads) * shape.head_dim;
  const T* q_src = query + seq * shape.query_stride + head * shape.head_dim;
  for (int d = threadIdx.x; d < shape.head_dim; d += blockDim.x) q[d] = to_float(q_src[d]);
  __syncthreads();

  float local_max = -INFINITY;
  for (int64_t pos = threadIdx.x; pos < seq_len; pos += blockDim.x) {
    const int64_t block = block_tables[seq * shape.max_blocks + pos / shape.block_size];
    const T* k = key_cache + (block * shape.block_size + pos % shape.block_size) * row +
                 kv_head * shape.head_dim;
    float dot = 0.f;
    for (int d = 0; d < shape.head_dim; ++d) dot += q[d] * to_float(k[d]);
    logits[pos] = dot * shape.scale;
    local_max = fmaxf(local_max, logits[pos]);
  }
  const float max_logit = block_max(local_max, scratch);
  float local_sum = 0.f;
  for (int64_t pos = threadIdx.x; pos < seq_len; pos += blockDim.x) {
    logits[pos] = __expf(logits[pos] - max_logit);
    local_sum += logits[pos];
  }
  const float inv_sum = 1.f / block_sum(local_sum, scratch);

  T* dst = out + seq * shape.out_stride + head * shape.head_dim;
  for (int d = threadIdx.x; d < shape.head_dim; d += blockDim.x) {
    float acc = 0.f;
    for (int64_t pos = 0; pos < seq_len; ++pos) {
      const int64_t block = block_tables[seq * shape.max_blocks + pos / shape.block_size];
      const T* v = value_cache + (block * shape.block_size + pos % shape.block_size) * row +
                   kv_head * shape.head_dim;
      acc += logits[pos] * to_float(v[d]);
    }
    dst[d] = from_float<T>(acc * inv_sum);
  }
}

template <typename T>
static void launch_reshape_and_cache(const void* key, const void* value, void* key_cache,
                                     void* value_cache, const int64_t* slot_mapping,
                                     int64_t num_tokens, int64_t key_stride,
                                     int64_t value_stride, int row, cudaStream_t stream) {
  const int threads = row < 1024 ? row : 1024;
  reshape_and_cache_kernel<T><<<num_tokens, threads, 0, stream>>>(
      static_cast<const T*>(key), static_cast<const T*>(value), static_cast<T*>(key_cache),
      static_cast<T*>(value_cache), slot_mapping, key_stride, value_stride, row);
}

constexpr int kDecodeThreads = 128;

size_t paged_decode_shared_bytes(const DecodeShape& shape) {
  return sizeof(float) * (shape.head_dim + static_cast<size_t>(shape.max_context) + kDecodeThreads);
}

template <typename T>
static void launch_paged_decode(void* out, const void* query, const void* key_cache,
                                const void* value_cache, const int64_t* block_tables,
                                const int64_t* seq_lens, int num_seqs, int num_heads,
                                const DecodeShape& shape, cudaStream_t stream) {
  const size_t shared = paged_decode_shared_bytes(shape);
  if (shared > 48 * 1024) {
    // Above 48 KB a kernel must opt in to dynamic shared memory (up to the device's limit,
    // 227 KB on H100/H200: contexts of about 58k tokens; bindings.cpp checks it).
    cudaFuncSetAttribute(paged_decode_kernel<T>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                         static_cast<int>(shared));
  }
  dim3 grid(num_seqs, num_heads);
  paged_decode_kernel<T><<<grid, kDecodeThreads, shared, stream>>>(
      static_cast<T*>(out), static_cast<const T*>(query), static_cast<const T*>(key_cache),
      static_cast<const T*>(value_cache), block_tables, seq_lens, shape);
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
                 int num_seqs, int num_heads, const DecodeShape& shape, cudaStream_t stream) {
  switch (dtype) {
    case DType::kFloat32:
      launch_paged_decode<float>(out, query, key_cache, value_cache, block_tables, seq_lens,
                                 num_seqs, num_heads, shape, stream);
      break;
    case DType::kFloat16:
      launch_paged_decode<__half>(out, query, key_cache, value_cache, block_tables, seq_lens,
                                  num_seqs, num_heads, shape, stream);
      break;
    case DType::kBFloat16:
      launch_paged_decode<__nv_bfloat16>(out, query, key_cache, value_cache, block_tables,
                                         seq_lens, num_seqs, num_heads, shape, stream);
      break;
  }
  return static_cast<int>(cudaGetLastError());
}

}  // namespace blockserve
