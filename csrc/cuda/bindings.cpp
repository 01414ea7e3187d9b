// Torch bindings for blockserve's CUDA kernels: tensor checks, dtype dispatch, the stream.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

#include "kernels.h"

namespace {

blockserve::DType dtype_of(const torch::Tensor& t) {
  switch (t.scalar_type()) {
    case torch::kFloat32: return blockserve::DType::kFloat32;
    case torch::kFloat16: return blockserve::DType::kFloat16;
    case torch::kBFloat16: return blockserve::DType::kBFloat16;
    default: TORCH_CHECK(false, "unsupported dtype ", t.scalar_type());
  }
}

void check_cuda_error(int error) {
  TORCH_CHECK(error == 0, "CUDA kernel launch failed: ", cudaGetErrorString(static_cast<cudaError_t>(error)));
}

// key, value: [num_tokens, kv_heads, head_dim] (rows contiguous);
// key_cache, value_cache: [num_blocks, block_size, kv_heads, head_dim] contiguous.
void reshape_and_cache(torch::Tensor key, torch::Tensor value, torch::Tensor key_cache,
                       torch::Tensor value_cache, torch::Tensor slot_mapping) {
  TORCH_CHECK(key.is_cuda() && key_cache.is_cuda(), "tensors must be on a CUDA device");
  TORCH_CHECK(key.stride(2) == 1 && key.stride(1) == key.size(2), "key rows must be contiguous");
  TORCH_CHECK(value.stride(2) == 1 && value.stride(1) == value.size(2), "value rows must be contiguous");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(slot_mapping.scalar_type() == torch::kInt64, "slot_mapping must be int64");
  const int row = static_cast<int>(key.size(1) * key.size(2));
  const c10::cuda::CUDAGuard device_guard(key.device());
  check_cuda_error(blockserve::reshape_and_cache(
      dtype_of(key), key.data_ptr(), value.data_ptr(), key_cache.data_ptr(),
      value_cache.data_ptr(), slot_mapping.data_ptr<int64_t>(), key.size(0), key.stride(0),
      value.stride(0), row, c10::cuda::getCurrentCUDAStream()));
}

// out, query: [num_seqs, heads, head_dim] (one decode query per sequence); max_seq_len: the
// longest context (host-side, for the split choice).
void paged_decode(torch::Tensor out, torch::Tensor query, torch::Tensor key_cache,
                  torch::Tensor value_cache, torch::Tensor block_tables, torch::Tensor seq_lens,
                  int64_t max_seq_len) {
  TORCH_CHECK(query.is_cuda(), "tensors must be on a CUDA device");
  TORCH_CHECK(query.stride(2) == 1 && query.stride(1) == query.size(2), "query rows must be contiguous");
  TORCH_CHECK(out.stride(2) == 1 && out.stride(1) == out.size(2), "out rows must be contiguous");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(block_tables.is_contiguous() && block_tables.scalar_type() == torch::kInt64,
              "block_tables must be contiguous int64");
  TORCH_CHECK(seq_lens.is_contiguous() && seq_lens.scalar_type() == torch::kInt64,
              "seq_lens must be contiguous int64");
  blockserve::DecodeShape shape;
  shape.num_kv_heads = static_cast<int>(key_cache.size(2));
  shape.queries_per_kv = static_cast<int>(query.size(1) / key_cache.size(2));
  shape.head_dim = static_cast<int>(query.size(2));
  shape.block_size = static_cast<int>(key_cache.size(1));
  shape.max_blocks = static_cast<int>(block_tables.size(1));
  shape.query_stride = query.stride(0);
  shape.out_stride = out.stride(0);
  shape.scale = 1.0f / std::sqrt(static_cast<float>(shape.head_dim));
  shape.num_splits = 1;
  TORCH_CHECK(blockserve::paged_decode_supports(shape),
              "the cuda backend's decode kernel takes head_dim 64, 128, 256 or at most 32 and a "
              "block size that is a multiple of 8; got head_dim ", shape.head_dim,
              ", block size ", shape.block_size, " (the triton backend takes others)");
  const c10::cuda::CUDAGuard device_guard(query.device());
  const int num_seqs = static_cast<int>(query.size(0));
  int multiprocessors = 0;
  check_cuda_error(cudaDeviceGetAttribute(&multiprocessors, cudaDevAttrMultiProcessorCount,
                                          query.device().index()));
  shape.num_splits = blockserve::paged_decode_splits(num_seqs, shape, max_seq_len, multiprocessors);
  torch::Tensor workspace;  // float32 scratch of a split launch, from torch's caching allocator
  if (shape.num_splits > 1) {
    const auto floats = static_cast<int64_t>(blockserve::paged_decode_workspace_floats(num_seqs, shape));
    workspace = torch::empty({floats}, query.options().dtype(torch::kFloat32));
  }
  check_cuda_error(blockserve::paged_decode(
      dtype_of(query), out.data_ptr(), query.data_ptr(), key_cache.data_ptr(),
      value_cache.data_ptr(), block_tables.data_ptr<int64_t>(), seq_lens.data_ptr<int64_t>(),
      num_seqs, shape, workspace.defined() ? workspace.data_ptr<float>() : nullptr,
      c10::cuda::getCurrentCUDAStream()));
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("reshape_and_cache", &reshape_and_cache, "write K/V into the paged cache");
  m.def("paged_decode", &paged_decode, "paged decode attention");
}
