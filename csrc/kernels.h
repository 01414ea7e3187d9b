// Launchers for blockserve's CUDA kernels (kernels.cu); raw pointers, no torch types.
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

namespace blockserve {

enum class DType { kFloat32, kFloat16, kBFloat16 };

struct DecodeShape {
  int num_kv_heads;
  int queries_per_kv;
  int head_dim;
  int block_size;
  int max_blocks;       // columns of block_tables
  int max_context;      // the longest sequence (sizes shared memory)
  int64_t query_stride; // elements between two decode queries
  int64_t out_stride;
  float scale;
};

// Both return a cudaError_t as int (0 = success).
int reshape_and_cache(DType dtype, const void* key, const void* value, void* key_cache,
                      void* value_cache, const int64_t* slot_mapping, int64_t num_tokens,
                      int64_t key_stride, int64_t value_stride, int row, cudaStream_t stream);

// Dynamic shared memory one paged_decode block needs for `shape`: the query, every score of
// the longest context, and reduction scratch (float32).
size_t paged_decode_shared_bytes(const DecodeShape& shape);

int paged_decode(DType dtype, void* out, const void* query, const void* key_cache,
                 const void* value_cache, const int64_t* block_tables, const int64_t* seq_lens,
                 int num_seqs, int num_heads, const DecodeShape& shape, cudaStream_t stream);

}  // namespace blockserve
