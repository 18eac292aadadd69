#pragma once
// A store's copies enqueued behind its walk (internal): each installment's copies handed to the
// process's copy thread, in order, while the store walks the next installment.
//
// Why: on the CUDA copier's DMA and staged paths each DMA piece costs the calling thread 0.4-0.9
// us in the driver, about what the store's index walk costs a page (docs/performance.md, "Where a
// store of small pages spends its call"). One thread did the two one after the other, so a
// 1024-page store held the engine's thread for both, and a load issued after it on another stream
// started only once both were done. With the copies on a thread of their own, the call takes
// about the longer of the two. Every copy is still enqueued before the store returns: wait()
// ends the call, so whatever the engine enqueues on the stream next comes after them all.
//
// The thread is process-wide, started at first use and parked between stores, as the page
// threads are (page_threads.hpp: threads started per call cost more than they saved). One store
// holds it at a time; a store that finds it held, in a forked child or where no thread can be
// had, runs its jobs as it adds them.

#include <exception>
#include <functional>

namespace hicache::detail {

class CopiesBehind {
 public:
  /// @param behind false: every job runs in add(), on the calling thread. True: on the copy
  ///        thread, taken at the first add() (if it is free then).
  explicit CopiesBehind(bool behind) : want_(behind) {}
  /// Waits for the jobs added (an exception one threw is dropped here).
  ~CopiesBehind() { drain(); }
  CopiesBehind(const CopiesBehind&) = delete;
  CopiesBehind& operator=(const CopiesBehind&) = delete;

  /// Runs job() after the jobs added before it: on the copy thread, or now. A job that throws
  /// ends the queue: the jobs after it do not run, and wait() rethrows its exception.
  void add(std::function<void()> job);
  /// Returns once every job added has run (or was dropped after one threw), then rethrows what
  /// the first that threw threw. The copy thread is free for other stores once it returned.
  void wait();
  /// wait(), dropping the exception.
  void drain() noexcept;
  /// Whether the jobs run on the copy thread (false again once wait() returned).
  bool behind() const { return behind_; }

 private:
  bool want_;
  bool behind_ = false;
  bool failed_ = false;  // a job threw: the rest are dropped
  std::exception_ptr failure_;
};

}  // namespace hicache::detail
