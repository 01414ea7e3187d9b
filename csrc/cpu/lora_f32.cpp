// LoRA's grouped products in float32 (lora.h).

#include "lora.h"

namespace {

void lora_add_f32(const at::Tensor& x, at::Tensor& out, const at::Tensor& a, const at::Tensor& b,
                  const at::Tensor& src, const at::Tensor& starts, const at::Tensor& slots,
                  at::IntArrayRef bounds, int64_t rank) {
  blockserve_cpu::lora_add_<float>(x, out, a, b, src, starts, slots, bounds, rank, at::kFloat);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(BLOCKSERVE_F32_OPS, m) { blockserve_cpu::define_lora(m); }

TORCH_LIBRARY_IMPL(BLOCKSERVE_F32_OPS, CPU, m) { m.impl("lora_add_", &lora_add_f32); }
