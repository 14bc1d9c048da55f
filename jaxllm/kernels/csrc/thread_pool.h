// A small persistent thread pool for the CPU attention kernel (jaxllm/kernels/cpu_attention.py).
//
// Owns: worker threads started once per process (first use), and `Run(n, fn)`, which calls
// fn(0) .. fn(n - 1) spread over the workers and the calling thread, handing out indices in
// order from one atomic counter (callers sort their items largest first), and returns when
// every call has finished. The caller waits only for items a worker has taken, never for a
// worker to wake up: a worker that is asleep, or descheduled on a busy machine, when the
// items run out does not hold the call back (it finds the job over when it gets there).
// Must never: spawn threads per call; block a second concurrent caller behind the first (a
// caller that finds the pool busy runs its items itself); spin while idle beyond the window
// its owner asked for (`spin_us`, 0 by default: other threads, XLA's and the other kernels'
// pools, run on the same cores between two calls), nor spin without yielding the core.
//
// Spinning: waking a thread blocked in the kernel costs tens of microseconds on a virtual
// machine (the idle vCPU has halted), as much as a whole small GEMM. A pool built with
// spin_us > 0 keeps its workers polling for the next job, and the caller polling for the
// workers' last items, for up to spin_us before blocking; each poll calls sched_yield(), so a
// runnable thread of anything else on that core goes first.

#ifndef JAXLLM_KERNELS_CSRC_THREAD_POOL_H_
#define JAXLLM_KERNELS_CSRC_THREAD_POOL_H_

#include <sched.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace jaxllm {

class ThreadPool {
 public:
  // Threads in all, the caller included: the environment variable `env_var` if set (>= 1),
  // else the CPUs this process may run on.
  static int DefaultSize(const char* env_var = "JAXLLM_CPU_ATTENTION_THREADS") {
    if (const char* env = std::getenv(env_var)) {
      int n = std::atoi(env);
      if (n >= 1) return n;
    }
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof(set), &set) == 0 && CPU_COUNT(&set) > 0) {
      return CPU_COUNT(&set);
    }
    unsigned n = std::thread::hardware_concurrency();
    return n > 0 ? static_cast<int>(n) : 1;
  }

  // The process-wide pool. Leaked on purpose: joining threads from a static destructor at
  // interpreter exit can deadlock.
  static ThreadPool& Get() {
    static ThreadPool* pool = new ThreadPool(DefaultSize());
    return *pool;
  }

  explicit ThreadPool(int size, int spin_us = 0)
      : size_(size < 1 ? 1 : size), spin_(std::chrono::microseconds(spin_us > 0 ? spin_us : 0)),
        owner_pid_(getpid()) {
    for (int i = 1; i < size_; ++i) workers_.emplace_back([this] { WorkerLoop(); });
  }

  int size() const { return size_; }

  void Run(int n, const std::function<void(int)>& fn) {
    if (n <= 0) return;
    // Inline when there is nothing to share, in a forked child (it has no workers), or when
    // another caller holds the pool.
    std::unique_lock<std::mutex> submit(submit_mu_, std::try_to_lock);
    if (n == 1 || workers_.empty() || getpid() != owner_pid_ || !submit.owns_lock()) {
      for (int i = 0; i < n; ++i) fn(i);
      return;
    }
    // The new job's tag goes up closed (no index to hand out) before its fields change, so a
    // late worker of the last job can no longer claim anything against them; the counter
    // opens after them, and a worker that claims an item of this job reads them after.
    const uint32_t job = ++job_;
    state_.store(static_cast<uint64_t>(job) << 32 | kClosed);
    fn_.store(&fn, std::memory_order_relaxed);
    num_items_.store(static_cast<uint32_t>(n), std::memory_order_relaxed);
    state_.store(static_cast<uint64_t>(job) << 32);
    {
      std::lock_guard<std::mutex> lock(mu_);
      generation_.store(job, std::memory_order_release);
    }
    wake_.notify_all();
    Drain(job);
    // Every item is taken; wait for the ones still running on a worker.
    auto idle = [this] { return in_flight_.load() == 0; };
    SpinUntil(idle);
    std::unique_lock<std::mutex> lock(mu_);
    done_.wait(lock, idle);
  }

 private:
  // Polls `ready` (yielding the core between polls) for up to spin_ (not at all when 0).
  template <class Ready>
  void SpinUntil(const Ready& ready) const {
    if (spin_.count() == 0 || ready()) return;
    const auto deadline = std::chrono::steady_clock::now() + spin_;
    while (!ready() && std::chrono::steady_clock::now() < deadline) sched_yield();
  }

  // Runs items of job `job` until none is left, or the job is over (a later one has begun).
  // An item is claimed by a compare-exchange of (job, index) -> (job, index + 1), so a
  // worker that wakes late never takes an item of a job it did not read.
  void Drain(uint32_t job) {
    uint64_t s = state_.load();
    for (;;) {
      if (static_cast<uint32_t>(s >> 32) != job) return;
      const uint32_t i = static_cast<uint32_t>(s);
      if (i >= num_items_.load(std::memory_order_relaxed)) return;  // kClosed included
      if (state_.compare_exchange_weak(s, s + 1)) {
        (*fn_.load(std::memory_order_relaxed))(static_cast<int>(i));
        s = state_.load();
      }
    }
  }

  void WorkerLoop() {
    uint32_t seen = 0;
    auto fresh = [&] { return generation_.load(std::memory_order_acquire) != seen; };
    for (;;) {
      SpinUntil(fresh);
      {
        std::unique_lock<std::mutex> lock(mu_);
        wake_.wait(lock, fresh);
        seen = generation_.load(std::memory_order_relaxed);
      }
      // In flight before claiming: a caller that sees every item taken then sees this count
      // (both sequentially consistent), and waits for the item this worker claims.
      in_flight_.fetch_add(1);
      Drain(seen);
      if (in_flight_.fetch_sub(1) == 1) {
        std::lock_guard<std::mutex> lock(mu_);  // the caller checks and sleeps under mu_
        done_.notify_one();
      }
    }
  }

  static constexpr uint32_t kClosed = 0xffffffffu;  // state_'s index while a job is set up

  const int size_;
  const std::chrono::microseconds spin_;
  const pid_t owner_pid_;
  std::vector<std::thread> workers_;
  std::mutex submit_mu_;  // one job at a time
  std::mutex mu_;         // the sleeping workers' and the waiting caller's condition variables
  std::condition_variable wake_, done_;
  uint32_t job_ = 0;                        // the last job's number (under submit_mu_)
  std::atomic<uint32_t> generation_{0};     // the job workers wake up for
  std::atomic<uint64_t> state_{0};          // (job << 32) | next item to hand out
  std::atomic<int> in_flight_{0};           // workers inside Drain
  std::atomic<const std::function<void(int)>*> fn_{nullptr};  // the job's, set before state_
  std::atomic<uint32_t> num_items_{0};
};

}  // namespace jaxllm

#endif  // JAXLLM_KERNELS_CSRC_THREAD_POOL_H_
