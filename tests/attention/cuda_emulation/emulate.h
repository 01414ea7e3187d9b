// Run CUDA kernels on the CPU, for tests: csrc/cuda/kernels.cu compiled by g++ with
// -DBLOCKSERVE_CPU_EMULATION includes this after the CUDA headers.
//
// Each CUDA thread of a block is a fiber (ucontext) with its own stack; one OS thread runs them
// in turn. __syncthreads() parks a fiber until every thread of the block has reached it;
// __shfl_xor_sync() parks it until every lane of its warp has posted its value. A kernel whose
// threads disagree on barriers (one waits where another never arrives) is reported as a
// deadlock instead of hanging. Blocks run one after another, so `__shared__` (made `static`
// here) is the running block's shared memory. What this checks: indexing, the reduction and
// synchronisation logic, and numerics in float32/float16/bfloat16; not speed or coalescing.
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>

#undef __shared__
#define __shared__ static
#define __launch_bounds__(...)

namespace emulate {

// The block being run and the fiber (thread) being run in it.
uint3 thread_index();
const uint3& block_index();
const dim3& block_dim();
const dim3& grid_dim();

enum class Wait { kBlock, kWarp };
void wait(Wait kind);  // park this fiber until its barrier is released
uint64_t* exchange_slot(unsigned thread);  // per-thread storage for warp shuffles
unsigned current_thread();

void launch(dim3 grid, dim3 block, const std::function<void()>& body);

template <typename T>
T shfl_xor(T value, int lane_mask) {
  static_assert(sizeof(T) <= sizeof(uint64_t));
  const unsigned me = current_thread();
  const unsigned lane = me % 32;
  std::memcpy(exchange_slot(me), &value, sizeof(T));
  wait(Wait::kWarp);  // every lane has posted
  T other;
  std::memcpy(&other, exchange_slot(me - lane + (lane ^ lane_mask)), sizeof(T));
  wait(Wait::kWarp);  // every lane has read before any slot is written again
  return other;
}

}  // namespace emulate

#define threadIdx (::emulate::thread_index())
#define blockIdx (::emulate::block_index())
#define blockDim (::emulate::block_dim())
#define gridDim (::emulate::grid_dim())

inline void __syncthreads() { ::emulate::wait(::emulate::Wait::kBlock); }

template <typename T>
T __shfl_xor_sync(unsigned /*mask*/, T value, int lane_mask, int /*width*/ = 32) {
  return ::emulate::shfl_xor(value, lane_mask);
}

inline float __expf(float x) { return std::exp(x); }
