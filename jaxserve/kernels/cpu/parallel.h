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

// How many drains (of any parallel call's items) this thread has begun: a body whose
// value is the same as at its thread's last body runs in the same drain, with nothing
// else run on the thread in between, so per-thread hardware state it set then (AMX's tile
// configuration, amx.h) is still set.
inline uint64_t& drain_epoch() {
  static thread_local uint64_t epoch = 0;
  return epoch;
}

// What both loops' states share: the items' counters and the caller's wait.
struct ParallelCounters {
  int64_t total = 0;
  int64_t threads = 1;  // the caller and its helpers
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  std::atomic<bool> failed{false};
  std::mutex mu;
  std::condition_variable cv;

  void finish_one() {
    if (done.fetch_add(1) + 1 == total) {
      std::lock_guard<std::mutex> lock(mu);
      cv.notify_all();
    }
  }
};

struct ParallelState : ParallelCounters {
  std::function<bool(int64_t)> body;  // returns false on bad input (reported as an error)

  void drain() {
    ++drain_epoch();
    for (int64_t i; (i = next.fetch_add(1)) < total;) {
      if (!body(i)) failed.store(true);
      finish_one();
    }
  }
};

// Runs st->drain() on the calling thread and up to max_helpers pool tasks (st->total
// items), then waits until every item is done; returns false if a body failed.
template <typename State>
inline bool run_parallel(xla::ffi::ThreadPool& pool, const std::shared_ptr<State>& st,
                         int64_t max_helpers) {
  const int64_t total = st->total;
  const int64_t helpers = std::min({pool.num_threads() - 1, total - 1, max_helpers});
  st->threads = helpers + 1;
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

// Runs body(i) for i in [0, total) on the calling thread and the pool; returns false if any
// call returned false. `max_helpers` caps the pool tasks (e.g. 0 for tiny problems).
inline bool parallel_for(xla::ffi::ThreadPool& pool, int64_t total,
                         std::function<bool(int64_t)> body, int64_t max_helpers = 1 << 30) {
  if (total <= 0) return true;
  auto st = std::make_shared<ParallelState>();
  st->body = std::move(body);
  st->total = total;
  return run_parallel(pool, st, max_helpers);
}

// parallel_for where a body may call ahead() to learn (and claim) the item its thread runs
// next, e.g. to prefetch that item's data while it works on i: a claimed item runs on that
// thread right after i (so the caller's wait for claimed items still ends). ahead()
// returns total (none) in the last round of items, where each thread takes its last one
// when it is free (a thread holding one claimed while another finds none left would idle
// that one for up to an item's time), and claims at most one item per item.
struct ParallelAheadState : ParallelCounters {
  std::function<bool(int64_t, const std::function<int64_t()>&)> body;

  void drain() {
    ++drain_epoch();
    int64_t i = next.fetch_add(1);
    while (i < total) {
      int64_t following = -1;  // claimed through ahead(), or not
      const std::function<int64_t()> ahead = [&] {
        if (following < 0 && next.load() + threads <= total) following = next.fetch_add(1);
        return following < 0 ? total : std::min(following, total);
      };
      if (!body(i, ahead)) failed.store(true);
      finish_one();
      i = following >= 0 ? following : next.fetch_add(1);
    }
  }
};

inline bool parallel_for_ahead(xla::ffi::ThreadPool& pool, int64_t total,
                               std::function<bool(int64_t, const std::function<int64_t()>&)> body,
                               int64_t max_helpers = 1 << 30) {
  if (total <= 0) return true;
  auto st = std::make_shared<ParallelAheadState>();
  st->body = std::move(body);
  st->total = total;
  return run_parallel(pool, st, max_helpers);
}

// Panels per item (a run of consecutive panels) for about items_per_call items a call.
inline int64_t panel_run(int64_t panels, int64_t items_per_call) {
  return std::max<int64_t>(1, panels / items_per_call);
}

// A matmul's work over its weight's `panels` panels and x's M rows: items of consecutive
// panels (about items_per_call of them a call), so each thread streams long contiguous
// stretches of the weight; a weight of few panels is also split by rows when x has at
// least 2 * min_split_rows of them (prefill), in chunks of a multiple of row_block (the
// register block: only the last chunk has a remainder), else two threads would get 5 and
// 4 of 9 panels and idle 10% of the call. Runs fn(panel, m_begin, m_end) for every panel
// and row range through parallel_for.
template <typename F>
inline void parallel_panels(xla::ffi::ThreadPool& pool, int64_t panels, int64_t M,
                            int64_t items_per_call, int64_t min_split_rows, int64_t row_block,
                            F fn) {
  const int64_t run = panel_run(panels, items_per_call);
  const int64_t runs = (panels + run - 1) / run;
  int64_t chunk = M;  // rows per item
  if (runs < items_per_call && M >= 2 * min_split_rows) {
    const int64_t want = std::min((items_per_call + runs - 1) / runs, M / min_split_rows);
    chunk = (M / want + row_block - 1) / row_block * row_block;
  }
  const int64_t row_chunks = (M + chunk - 1) / chunk;
  parallel_for(pool, runs * row_chunks, [&](int64_t item) {
    const int64_t r = item / row_chunks, m_begin = item % row_chunks * chunk;
    const int64_t m_end = std::min(M, m_begin + chunk);
    for (int64_t pi = r * run; pi < std::min(panels, (r + 1) * run); ++pi) fn(pi, m_begin, m_end);
    return true;
  });
}

// parallel_panels for few rows of x and a fn(panel, m_begin, m_end, next_panel) that
// prefetches: next_panel() is the panel its thread multiplies next (-1: none known), the
// next panel of the item or, for an item's last panel, the first of the item the thread
// claims then (parallel_for_ahead); fn calls it at most once. Each item is a run of
// panels over all M rows, except where the runs do not divide evenly over the threads
// (caller and helpers): then each of the last runs % threads runs is split by rows into
// one chunk per thread (a multiple of row_block rows, at least two blocks: M >= threads *
// 2 * row_block), so the last round ends together. Two threads on a weight of 9 panels
// otherwise multiply 5 and 4: one idles a panel's time (a 32-row decode step's o and down
// projections on a 2-core Zen 4 VM: the caller finished ~14 and ~32 us after its helper,
// medians over 169 calls each, in calls of ~77 and ~200 us; the split took them to ~4 us
// and the step from a median 45.4 to 43.6 ms). A chunk reads its whole panel, so the
// split is kept to rows that make a panel's arithmetic outweigh its read: at 16 rows
// (8-row chunks) the step measured no faster.
template <typename F>
inline void parallel_panels_ahead(xla::ffi::ThreadPool& pool, int64_t panels, int64_t M,
                                  int64_t items_per_call, int64_t row_block, F fn) {
  const int64_t run = panel_run(panels, items_per_call);
  const int64_t runs = (panels + run - 1) / run;
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(pool.num_threads(), runs));
  const int64_t split = M >= threads * 2 * row_block ? runs % threads : 0;  // split by rows
  const int64_t whole = runs - split;
  const int64_t chunk = split > 0 ? (M / threads + row_block - 1) / row_block * row_block : M;
  const int64_t chunks = (M + chunk - 1) / chunk;  // row chunks of a split run
  // item -> (run, first row, end row): whole runs first, then the split runs' chunks
  auto item_run = [=](int64_t i) { return i < whole ? i : whole + (i - whole) / chunks; };
  parallel_for_ahead(pool, whole + split * chunks,
                     [&](int64_t i, const std::function<int64_t()>& ahead) {
    const int64_t r = item_run(i);
    const int64_t m_begin = i < whole ? 0 : (i - whole) % chunks * chunk;
    const int64_t m_end = i < whole ? M : std::min(M, m_begin + chunk);
    const int64_t last = std::min(panels, (r + 1) * run) - 1;
    for (int64_t pi = r * run; pi <= last; ++pi)
      fn(pi, m_begin, m_end, [&]() -> int64_t {
        if (pi < last) return pi + 1;
        const int64_t following = ahead();
        return following < whole + split * chunks ? item_run(following) * run : -1;
      });
    return true;
  });
}

}  // namespace jaxserve
