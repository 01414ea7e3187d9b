// The fiber scheduler behind emulate.h, csrc/cuda/kernels.cu itself, and a C entry point per
// launcher for ctypes (tests/attention/test_csrc_emulated.py builds this with g++).

#include "emulate.h"

#include <ucontext.h>

#include <cstdio>
#include <memory>
#include <stdexcept>
#include <vector>

#include "kernels.cu"

namespace emulate {
namespace {

enum class State { kRunnable, kAtBlockBarrier, kAtWarpBarrier, kDone };

struct Fiber {
  ucontext_t context;
  std::unique_ptr<char[]> stack;
  State state = State::kRunnable;
};

constexpr size_t kStackBytes = 256 * 1024;

struct Block {
  uint3 index;
  dim3 dim;
  dim3 grid;
  unsigned current = 0;
  std::vector<Fiber> fibers;
  std::vector<uint64_t> slots;
  ucontext_t scheduler;
  const std::function<void()>* body = nullptr;
};

Block* running = nullptr;

void fiber_main() {
  (*running->body)();
  running->fibers[running->current].state = State::kDone;
  // Returning resumes uc_link: the scheduler.
}

// Release every barrier all of whose threads have arrived; true if any was released.
bool release_barriers(Block& block) {
  bool released = false;
  const unsigned count = static_cast<unsigned>(block.fibers.size());
  for (unsigned warp = 0; warp * 32 < count; ++warp) {
    bool all = true;
    for (unsigned t = warp * 32; t < count && t < warp * 32 + 32; ++t) {
      all = all && block.fibers[t].state == State::kAtWarpBarrier;
    }
    if (!all) continue;
    for (unsigned t = warp * 32; t < count && t < warp * 32 + 32; ++t) {
      block.fibers[t].state = State::kRunnable;
    }
    released = true;
  }
  bool waiting = false;
  bool all_arrived = true;
  for (const Fiber& fiber : block.fibers) {
    waiting = waiting || fiber.state == State::kAtBlockBarrier;
    all_arrived = all_arrived &&
                  (fiber.state == State::kAtBlockBarrier || fiber.state == State::kDone);
  }
  if (waiting && all_arrived) {
    for (Fiber& fiber : block.fibers) {
      if (fiber.state == State::kAtBlockBarrier) fiber.state = State::kRunnable;
    }
    released = true;
  }
  return released;
}

void run_block(Block& block) {
  for (Fiber& fiber : block.fibers) {
    fiber.state = State::kRunnable;
    getcontext(&fiber.context);
    fiber.context.uc_stack.ss_sp = fiber.stack.get();
    fiber.context.uc_stack.ss_size = kStackBytes;
    fiber.context.uc_link = &block.scheduler;
    makecontext(&fiber.context, fiber_main, 0);
  }
  while (true) {
    bool ran = false;
    bool done = true;
    for (unsigned t = 0; t < block.fibers.size(); ++t) {
      if (block.fibers[t].state == State::kRunnable) {
        block.current = t;
        swapcontext(&block.scheduler, &block.fibers[t].context);
        ran = true;
      }
      done = done && block.fibers[t].state == State::kDone;
    }
    if (done) return;
    if (!release_barriers(block) && !ran) {
      throw std::runtime_error("deadlock: threads wait at barriers the others never reach");
    }
  }
}

}  // namespace

uint3 thread_index() {
  const unsigned t = running->current;
  return make_uint3(t % running->dim.x, (t / running->dim.x) % running->dim.y,
                    t / (running->dim.x * running->dim.y));
}
const uint3& block_index() { return running->index; }
const dim3& block_dim() { return running->dim; }
const dim3& grid_dim() { return running->grid; }
unsigned current_thread() { return running->current; }
uint64_t* exchange_slot(unsigned thread) { return &running->slots[thread]; }

void wait(Wait kind) {
  Fiber& fiber = running->fibers[running->current];
  fiber.state = kind == Wait::kBlock ? State::kAtBlockBarrier : State::kAtWarpBarrier;
  swapcontext(&fiber.context, &running->scheduler);
}

void launch(dim3 grid, dim3 block_dim, const std::function<void()>& body) {
  Block block;
  block.dim = block_dim;
  block.grid = grid;
  block.body = &body;
  const unsigned threads = block_dim.x * block_dim.y * block_dim.z;
  block.fibers.resize(threads);
  for (Fiber& fiber : block.fibers) fiber.stack = std::make_unique<char[]>(kStackBytes);
  block.slots.resize(threads);
  running = &block;
  for (unsigned z = 0; z < grid.z; ++z) {
    for (unsigned y = 0; y < grid.y; ++y) {
      for (unsigned x = 0; x < grid.x; ++x) {
        block.index = make_uint3(x, y, z);
        run_block(block);
      }
    }
  }
  running = nullptr;
}

}  // namespace emulate

// No CUDA runtime is linked: kernels.cu's launchers ask it only for the last launch error.
extern "C" cudaError_t cudaGetLastError(void) { return cudaSuccess; }

extern "C" {

int emulated_reshape_and_cache(int dtype, const void* key, const void* value, void* key_cache,
                               void* value_cache, const int64_t* slot_mapping,
                               int64_t num_tokens, int64_t key_stride, int64_t value_stride,
                               int row) {
  return blockserve::reshape_and_cache(static_cast<blockserve::DType>(dtype), key, value,
                                       key_cache, value_cache, slot_mapping, num_tokens,
                                       key_stride, value_stride, row, nullptr);
}

blockserve::DecodeShape decode_shape(int num_kv_heads, int queries_per_kv, int head_dim,
                                     int block_size, int max_blocks, int64_t query_stride,
                                     int64_t out_stride, float scale, int num_splits) {
  return blockserve::DecodeShape{num_kv_heads, queries_per_kv, head_dim,  block_size, max_blocks,
                                 query_stride, out_stride,     scale,     num_splits};
}

// Returns the launcher's error code, or -1 if the emulator found a deadlock. The split
// workspace is allocated here, poisoned with NaN.
int emulated_paged_decode(int dtype, void* out, const void* query, const void* key_cache,
                          const void* value_cache, const int64_t* block_tables,
                          const int64_t* seq_lens, int num_seqs, int num_kv_heads,
                          int queries_per_kv, int head_dim, int block_size, int max_blocks,
                          int64_t query_stride, int64_t out_stride, float scale,
                          int num_splits) {
  const blockserve::DecodeShape shape =
      decode_shape(num_kv_heads, queries_per_kv, head_dim, block_size, max_blocks, query_stride,
                   out_stride, scale, num_splits);
  std::vector<float> workspace(blockserve::paged_decode_workspace_floats(num_seqs, shape), NAN);
  try {
    return blockserve::paged_decode(static_cast<blockserve::DType>(dtype), out, query,
                                    key_cache, value_cache, block_tables, seq_lens, num_seqs,
                                    shape, workspace.empty() ? nullptr : workspace.data(),
                                    nullptr);
  } catch (const std::runtime_error& error) {
    std::fprintf(stderr, "%s\n", error.what());
    return -1;
  }
}

int emulated_decode_splits(int num_seqs, int num_kv_heads, int queries_per_kv,
                           int64_t max_seq_len, int multiprocessors) {
  const blockserve::DecodeShape shape =
      decode_shape(num_kv_heads, queries_per_kv, 128, 16, 1, 0, 0, 1.f, 1);
  return blockserve::paged_decode_splits(num_seqs, shape, max_seq_len, multiprocessors);
}

}  // extern "C"
