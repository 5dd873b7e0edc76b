// parallel_for over XLA's intra-op thread pool, shared by the CPU kernels.
//
// Items 0 .. total-1 are handed out dynamically (an atomic counter) to the calling thread
// and up to pool.num_threads() - 1 pool tasks, so ragged items balance: one thread per pool
// thread in all, the caller included. (With pool.num_threads() tasks on 2 cores the extra
// one queued behind the others: a helper started a mean ~45 us after it was scheduled, the
// length of a whole 1-row matmul call; with one helper ~3.5 us, and a single-stream decode
// step took ~13-15.5 ms instead of ~15.5-18.5, measured alternately on a 2-core VM.)
// The caller works too and then waits only for items already claimed: a pool task that
// starts late (the pool busy, or the caller itself a pool thread) finds no item left and
// touches nothing but the shared state, which it co-owns through a shared_ptr. So the call
// never deadlocks on a saturated pool and returns as soon as every item is done.
//
// Source: the work-sharing loop of Eigen's ThreadPoolDevice::parallelFor, reduced to
// dynamic single-item claims.
#pragma once

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>

#include "xla/ffi/api/ffi.h"

namespace jaxserve {

struct ParallelState {
  std::function<bool(int64_t)> body;  // returns false on bad input (reported as an error)
  int64_t total = 0;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  std::atomic<bool> failed{false};
  std::mutex mu;
  std::condition_variable cv;

  void drain() {
    for (int64_t i; (i = next.fetch_add(1)) < total;) {
      if (!body(i)) failed.store(true);
      if (done.fetch_add(1) + 1 == total) {
        std::lock_guard<std::mutex> lock(mu);
        cv.notify_all();
      }
    }
  }
};

// Runs body(i) for i in [0, total) on the calling thread and the pool; returns false if any
// call returned false. `max_helpers` caps the pool tasks (e.g. 0 for tiny problems).
inline bool parallel_for(xla::ffi::ThreadPool& pool, int64_t total,
                         std::function<bool(int64_t)> body, int64_t max_helpers = 1 << 30) {
  if (total <= 0) return true;
  auto st = std::make_shared<ParallelState>();
  st->body = std::move(body);
  st->total = total;
  const int64_t helpers = std::min({pool.num_threads() - 1, total - 1, max_helpers});
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([st] { st->drain(); });
  st->drain();
  // Items claimed by helpers are short: spin briefly before sleeping.
  for (int spin = 0; spin < 20000 && st->done.load() != total; ++spin) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
  }
  if (st->done.load() != total) {
    std::unique_lock<std::mutex> lock(st->mu);
    st->cv.wait(lock, [&] { return st->done.load() == total; });
  }
  return !st->failed.load();
}

}  // namespace jaxserve
