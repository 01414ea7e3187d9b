// Work split across torch's threads with stealing. at::parallel_for hands each thread a fixed,
// equal run of tasks, so the thread whose run costs more (a causal prefill's later rows, a
// longer sequence) or whose core the host slows holds every other at the region's end (perf,
// a no-sharing run on a 2-vCPU host: each thread spent 5-7% of its samples in libgomp waiting
// for the other there). Here each thread still starts on its own contiguous run, taken from
// the front (a thread's share of a weight stays one sequential stream), and a thread whose run
// is done takes the others' remaining tasks from their backs. Internal linkage, as in
// attention.h.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>

namespace blockserve_cpu {
namespace {

struct NoScope {};

// One thread's tasks not yet taken, [begin, end), in one word: begin in the high half.
struct alignas(64) TaskRun {
  std::atomic<uint64_t> bounds;

  static uint64_t pack(uint64_t begin, uint64_t end) { return begin << 32 | end; }

  // The run's first task (front) or last (back) into `task`, if it has one left.
  bool take(bool front, int64_t& task) {
    uint64_t seen = bounds.load(std::memory_order_relaxed);
    while (true) {
      const uint64_t begin = seen >> 32, end = seen & 0xffffffffu;
      if (begin >= end) return false;
      const uint64_t left = front ? pack(begin + 1, end) : pack(begin, end - 1);
      if (bounds.compare_exchange_weak(seen, left, std::memory_order_relaxed)) {
        task = static_cast<int64_t>(front ? begin : end - 1);
        return true;
      }
    }
  }
};

// body(task) for tasks 0 .. count - 1 (count < 2^32), on up to torch's thread count of
// threads, each holding a Scope (AMX's tile configuration, say) around the tasks it runs.
// Inside another parallel region, or with one thread, the caller runs them all in order.
template <class Scope = NoScope, typename Body>
void parallel_tasks(int64_t count, const Body& body) {
  if (count <= 0) return;
  const int64_t threads = std::min<int64_t>(count, at::get_num_threads());
  if (threads <= 1 || at::in_parallel_region()) {
    [[maybe_unused]] const Scope scope;
    for (int64_t task = 0; task < count; ++task) body(task);
    return;
  }
  const auto runs = std::make_unique<TaskRun[]>(threads);
  for (int64_t i = 0; i < threads; ++i)
    runs[i].bounds.store(TaskRun::pack(i * count / threads, (i + 1) * count / threads));
  at::parallel_for(0, threads, 1, [&](int64_t first, int64_t last) {
    [[maybe_unused]] const Scope scope;
    int64_t task = 0;
    for (int64_t own = first; own < last; ++own)
      while (runs[own].take(true, task)) body(task);
    for (int64_t i = 1; i < threads; ++i)  // the others' runs, from the next thread's on
      for (TaskRun& other = runs[(last - 1 + i) % threads]; other.take(false, task);) body(task);
  });
}

}  // namespace
}  // namespace blockserve_cpu
