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
  int64_t query_stride; // elements between two decode queries
  int64_t out_stride;
  float scale;
  int num_splits;       // parts each context is cut into (1: no split, no workspace)
};

// Whether paged_decode handles `shape`: head_dim 64, 128, 256 or at most 32, and a block size
// that is a multiple of 8.
bool paged_decode_supports(const DecodeShape& shape);

// How many splits fill a device of `multiprocessors` SMs: about two blocks per SM when the
// batch alone gives fewer, each split keeping every warp two steps (64 keys) of work; at most 32.
int paged_decode_splits(int num_seqs, const DecodeShape& shape, int64_t max_seq_len,
                        int multiprocessors);

// float32 elements of scratch a split decode needs (0 when shape.num_splits == 1).
size_t paged_decode_workspace_floats(int num_seqs, const DecodeShape& shape);

// Both return a cudaError_t as int (0 = success).
int reshape_and_cache(DType dtype, const void* key, const void* value, void* key_cache,
                      void* value_cache, const int64_t* slot_mapping, int64_t num_tokens,
                      int64_t key_stride, int64_t value_stride, int row, cudaStream_t stream);

// One decode query per sequence: out, query [num_seqs, num_heads, head_dim] (rows of each
// sequence contiguous), attending the sequence's whole paged context. `workspace` holds
// paged_decode_workspace_floats() floats (unused, may be null, when unsplit).
int paged_decode(DType dtype, void* out, const void* query, const void* key_cache,
                 const void* value_cache, const int64_t* block_tables, const int64_t* seq_lens,
                 int num_seqs, const DecodeShape& shape, float* workspace, cudaStream_t stream);

}  // namespace blockserve
