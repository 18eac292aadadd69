#pragma once
// for_each_page (internal): runs fn(i) for i in [0, n) on several threads when the pages are
// many bytes, so a pass over a tier round (copy and checksum each page, 64 MiB) runs at the
// host's memory bandwidth instead of one core's, and a long prompt's pages hash in parallel. On
// an H200 host one core copied and summed a 64 MiB round of fetched pages in about 20 ms while
// the store's own get of it took 11 ms.
//
// The helpers are a process-wide pool, started at first use and parked between calls: a thread
// started and joined per call cost more than the work it took (on the H200 host a store of 1024
// small pages went from 1.9 to 3.7 ms of CPU when its hashing started threads per call, in a
// process with CUDA and torch threads). One call uses the pool at a time; a call made while
// another has it runs on its own thread, so callers never wait for each other.

#include <cstddef>
#include <functional>

namespace hicache::detail {

inline constexpr std::size_t kBytesPerThread = std::size_t{8} << 20;
inline constexpr unsigned kMaxPageThreads = 8;
// The tier thread's passes (summing a put's round, checking a fetched one) sit between the store
// and its put, or between the get and the pages' use, with nothing else for the host's cores to
// do: they take up to 16 cores, a megabyte each at least. On an H200 host (16 cores) 8 threads
// summed a 64 MiB round in about 1.2 ms before its put could start (the put itself: 9 ms).
inline constexpr std::size_t kTierBytesPerThread = std::size_t{1} << 20;
inline constexpr unsigned kTierPageThreads = 16;

/// Runs share(t) for t in [0, shares) on the pool's helpers and the calling thread, and returns
/// once every share ran. Runs them all on the calling thread if the pool is busy or cannot start.
/// If a share throws, the exception is rethrown here once the shares that started have ended
/// (a helper never lets it escape its thread).
void run_shares(std::size_t shares, const std::function<void(std::size_t)>& share);

/// One task on the process's background thread while the caller goes on with other work (a
/// long store's chain keys are hashed there while the store walks and copies its first pages).
/// One task at a time in the process: start() starts nothing, and returns false, while another
/// task runs, in a forked child, or where no thread can be had; the caller then does the work
/// itself. The thread is started at first use and parked between tasks.
class BackgroundTask {
 public:
  BackgroundTask() = default;
  /// Waits for the task, if one was started (an exception it threw is dropped here).
  ~BackgroundTask();
  BackgroundTask(const BackgroundTask&) = delete;
  BackgroundTask& operator=(const BackgroundTask&) = delete;
  /// Starts task() on the background thread; false if it is not free (nothing started).
  bool start(std::function<void()> task);
  /// Returns once the started task has run, rethrowing what it threw; at once if none was
  /// started or it was waited for already.
  void wait();

 private:
  bool started_ = false;
};

/// How many threads a pass over n pages of page_bytes each should use (1: the calling thread):
/// a thread per bytes_per_thread, at most max_threads and the host's cores.
std::size_t page_threads(std::size_t n, std::size_t page_bytes, std::size_t bytes_per_thread,
                         std::size_t max_threads = kMaxPageThreads);

template <class Fn>
void for_each_page(std::size_t n, std::size_t page_bytes, Fn&& fn,
                   std::size_t bytes_per_thread = kBytesPerThread,
                   std::size_t max_threads = kMaxPageThreads) {
  const std::size_t threads = page_threads(n, page_bytes, bytes_per_thread, max_threads);
  if (threads <= 1) {  // most calls (the CPU copier's every load and store): no threads
    for (std::size_t i = 0; i < n; ++i) fn(i);
    return;
  }
  // Contiguous shares (each thread streams through its own pages).
  run_shares(threads, [&](std::size_t t) {
    const std::size_t begin = n * t / threads, end = n * (t + 1) / threads;
    for (std::size_t i = begin; i < end; ++i) fn(i);
  });
}

}  // namespace hicache::detail
