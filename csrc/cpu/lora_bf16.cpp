// LoRA's grouped products in bf16 (lora.h), summed in float32.

#include "lora.h"

namespace {

void lora_add_bf16(const at::Tensor& x, at::Tensor& out, const at::Tensor& a, const at::Tensor& b,
                   const at::Tensor& src, const at::Tensor& starts, const at::Tensor& slots,
                   at::IntArrayRef bounds, int64_t rank) {
  blockserve_cpu::lora_add_<uint16_t>(x, out, a, b, src, starts, slots, bounds, rank,
                                      at::kBFloat16);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(blockserve_cpu, m) { blockserve_cpu::define_lora(m); }

TORCH_LIBRARY_IMPL(blockserve_cpu, CPU, m) { m.impl("lora_add_", &lora_add_bf16); }
