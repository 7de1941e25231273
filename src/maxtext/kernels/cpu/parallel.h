// Work sharing for the CPU kernels: a call's tasks are claimed from a shared counter by the calling thread and by
// this library's helper threads (one fewer than the CPU's hardware threads, at most kMaxHelpers).
//
// A decode step calls the kernels every few tens of microseconds, each call reading one or a few MB. Waking a
// sleeping thread of XLA's pool takes about as long as such a call, so the helper came late or not at all and the
// caller read most of the weights alone. The helpers here stay awake between calls: after a call they poll for the
// next one for kSpinMicros, yielding the core to any other runnable thread at every poll, then sleep until a call
// wakes them. The caller never waits for a task that has not started (a late helper finds none left), only for
// tasks a helper is running.

#ifndef MAXTEXT_KERNELS_CPU_PARALLEL_H_
#define MAXTEXT_KERNELS_CPU_PARALLEL_H_

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <utility>

namespace maxtext_cpu {

// One call's tasks: `body(task)` for task in [0, num_tasks).
struct Job {
  std::function<void(int64_t)> body;
  int64_t num_tasks = 0;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};

  void Work() {
    for (int64_t task = next.fetch_add(1); task < num_tasks; task = next.fetch_add(1)) {
      body(task);
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

class Helpers {
 public:
  static constexpr int kMaxHelpers = 7;
  static constexpr int kSpinMicros = 500;

  // The process's helpers, started on first use and never stopped (they outlive static destruction).
  static Helpers& Get() {
    static Helpers* helpers = new Helpers();
    return *helpers;
  }

  int count() const { return count_; }

  // Offers `job` to the helpers; they take its tasks until none is left.
  void Post(std::shared_ptr<Job> job) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      job_ = std::move(job);
      epoch_.fetch_add(1, std::memory_order_release);
    }
    if (sleeping_.load(std::memory_order_acquire) > 0) wake_.notify_all();
  }

 private:
  Helpers() : count_(std::clamp<int>(static_cast<int>(std::thread::hardware_concurrency()) - 1, 0, kMaxHelpers)) {
    for (int i = 0; i < count_; ++i) std::thread([this] { Loop(); }).detach();
  }

  void Loop() {
    uint64_t seen = epoch_.load(std::memory_order_acquire);
    for (;;) {
      WaitForNewJob(seen);
      std::shared_ptr<Job> job;
      {
        std::lock_guard<std::mutex> lock(mu_);
        seen = epoch_.load(std::memory_order_acquire);
        job = job_;
      }
      if (job) job->Work();
    }
  }

  void WaitForNewJob(uint64_t seen) {
    const auto start = std::chrono::steady_clock::now();
    for (int polls = 1; epoch_.load(std::memory_order_acquire) == seen; ++polls) {
      _mm_pause();
      if (polls % 64 != 0) continue;
      std::this_thread::yield();
      if (std::chrono::steady_clock::now() - start < std::chrono::microseconds(kSpinMicros)) continue;
      std::unique_lock<std::mutex> lock(mu_);
      sleeping_.fetch_add(1, std::memory_order_acq_rel);
      wake_.wait(lock, [&] { return epoch_.load(std::memory_order_acquire) != seen; });
      sleeping_.fetch_sub(1, std::memory_order_acq_rel);
      return;
    }
  }

  const int count_;
  std::mutex mu_;
  std::condition_variable wake_;
  std::shared_ptr<Job> job_;  // the latest call's job (older calls finish on their own threads)
  std::atomic<uint64_t> epoch_{0};
  std::atomic<int> sleeping_{0};
};

// Runs `body(task)` for task in [0, num_tasks) on the calling thread and the helpers; returns when all ran.
template <typename Body>
void ParallelChunks(int64_t num_tasks, Body body) {
  auto job = std::make_shared<Job>();
  job->body = std::move(body);
  job->num_tasks = num_tasks;
  if (num_tasks > 1 && Helpers::Get().count() > 0) Helpers::Get().Post(job);
  job->Work();
  for (int polls = 1; job->done.load(std::memory_order_acquire) < num_tasks; ++polls) {
    _mm_pause();
    if (polls % 64 == 0) std::this_thread::yield();  // a helper sharing this core finishes its task
  }
}

}  // namespace maxtext_cpu

#endif  // MAXTEXT_KERNELS_CPU_PARALLEL_H_
