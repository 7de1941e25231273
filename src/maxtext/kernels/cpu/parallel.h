// Work sharing for the CPU kernels: tasks claimed from a shared counter by the calling thread and XLA's intra-op
// thread pool, so a call never waits for a task that has not started (helpers that start late find no task left).

#ifndef MAXTEXT_KERNELS_CPU_PARALLEL_H_
#define MAXTEXT_KERNELS_CPU_PARALLEL_H_

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace maxtext_cpu {

// Runs `body(task)` for task in [0, num_tasks) on the calling thread and the pool's threads; returns when all ran.
template <typename Body>
void ParallelChunks(xla::ffi::ThreadPool& pool, int64_t num_tasks, Body body) {
  struct Shared {
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
  };
  auto shared = std::make_shared<Shared>();
  auto work = [shared, num_tasks, body]() {
    for (int64_t c = shared->next.fetch_add(1); c < num_tasks; c = shared->next.fetch_add(1)) {
      body(c);
      shared->done.fetch_add(1, std::memory_order_release);
    }
  };
  int64_t helpers = std::min<int64_t>(pool.num_threads(), num_tasks - 1);
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule(decltype(work)(work));
  work();
  while (shared->done.load(std::memory_order_acquire) < num_tasks) std::this_thread::yield();
}

}  // namespace maxtext_cpu

#endif  // MAXTEXT_KERNELS_CPU_PARALLEL_H_
