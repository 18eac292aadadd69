#include "page_threads.hpp"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <exception>
#include <mutex>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

namespace hicache::detail {
namespace {

// Helpers park on a condition variable; a call publishes a job (a generation number), takes
// shares itself from the same counter and waits until every share taken has finished.
// Never destroyed (so exit never waits for a helper), and not used in a forked child, whose
// copies of its mutexes and condition variables may be held or waited on by threads that do not
// exist there: a child's passes run on its calling thread.
class Pool {
 public:
  bool try_run(std::size_t shares, const std::function<void(std::size_t)>& share) {
    if (::getpid() != owner_) return false;
    std::unique_lock<std::mutex> busy(busy_, std::try_to_lock);
    if (!busy.owns_lock() || !ready(shares - 1)) return false;
    {
      std::unique_lock<std::mutex> g(mu_);
      // A helper still leaving the last job's work() could take a ticket of this one with the
      // last one's count: wait until none is in it.
      done_.wait(g, [&] { return active_ == 0; });
      job_ = &share;
      shares_ = shares;
      next_.store(0);
      finished_ = 0;
      ++generation_;
    }
    wake_.notify_all();
    work();
    std::exception_ptr failure;
    {
      std::unique_lock<std::mutex> g(mu_);
      done_.wait(g, [&] { return finished_ == shares_; });
      failure = std::exchange(failure_, nullptr);
    }
    if (failure) std::rethrow_exception(failure);  // the first share that threw, on any thread
    return true;
  }

 private:
  // At least `want` helpers, started now if need be; false if none can be had.
  bool ready(std::size_t want) {
    while (helpers_.size() < want) {
      try {
        helpers_.emplace_back([this, seen = generation_] { loop(seen); });
      } catch (const std::system_error&) {
        break;
      }
    }
    return !helpers_.empty();
  }

  void loop(std::uint64_t seen) {
    for (;;) {  // parked until the next job, for the life of the process
      {
        std::unique_lock<std::mutex> g(mu_);
        wake_.wait(g, [&] { return generation_ != seen; });
        seen = generation_;
        ++active_;
      }
      work();
      std::lock_guard<std::mutex> g(mu_);
      if (--active_ == 0) done_.notify_all();
    }
  }

  // Takes shares until none is left; the last one to finish wakes the caller.
  void work() {
    for (;;) {
      const std::size_t t = next_.fetch_add(1);
      if (t >= shares_) return;
      std::exception_ptr failure;
      try {
        (*job_)(t);
      } catch (...) {
        failure = std::current_exception();
      }
      std::lock_guard<std::mutex> g(mu_);
      if (failure && !failure_) failure_ = failure;
      if (++finished_ == shares_) done_.notify_all();
    }
  }

  std::mutex busy_;  // one call at a time
  std::mutex mu_;
  std::condition_variable wake_, done_;
  std::vector<std::thread> helpers_;
  pid_t owner_ = ::getpid();
  std::uint64_t generation_ = 0;
  const std::function<void(std::size_t)>* job_ = nullptr;
  std::size_t shares_ = 0;
  std::atomic<std::size_t> next_{0};
  std::size_t finished_ = 0;
  std::size_t active_ = 0;      // helpers inside work()
  std::exception_ptr failure_;  // the job's first exception
};

Pool& pool() {
  static Pool* p = new Pool;
  return *p;
}

// The background thread: parked until a task is handed to it; one owner (a BackgroundTask) at a
// time, from start() until its wait(). Never destroyed, as the pool.
class Background {
 public:
  bool try_start(std::function<void()>& task) {
    if (::getpid() != owner_) return false;
    std::lock_guard<std::mutex> g(mu_);
    if (owned_) return false;
    if (!thread_.joinable()) {
      try {
        thread_ = std::thread([this] { loop(); });
      } catch (const std::system_error&) {
        return false;
      }
    }
    task_ = std::move(task);
    owned_ = true;
    done_ = false;
    failure_ = nullptr;
    wake_.notify_one();
    return true;
  }

  std::exception_ptr wait() {
    std::unique_lock<std::mutex> g(mu_);
    finished_.wait(g, [&] { return done_; });
    owned_ = false;
    return std::exchange(failure_, nullptr);
  }

 private:
  void loop() {
    std::unique_lock<std::mutex> g(mu_);
    for (;;) {
      wake_.wait(g, [&] { return task_ != nullptr; });
      std::function<void()> task = std::exchange(task_, nullptr);
      g.unlock();
      std::exception_ptr failure;
      try {
        task();
      } catch (...) {
        failure = std::current_exception();
      }
      task = nullptr;  // what it holds goes before its owner is told it ran
      g.lock();
      failure_ = failure;
      done_ = true;
      finished_.notify_all();
    }
  }

  std::mutex mu_;
  std::condition_variable wake_, finished_;
  std::thread thread_;
  pid_t owner_ = ::getpid();
  std::function<void()> task_;  // handed over, not taken yet
  bool owned_ = false;          // a BackgroundTask holds the thread (start to wait)
  bool done_ = false;
  std::exception_ptr failure_;
};

Background& background() {
  static Background* b = new Background;
  return *b;
}

}  // namespace

BackgroundTask::~BackgroundTask() {
  try {
    wait();
  } catch (...) {  // the owner's own error (if any) is the one that matters now
  }
}

bool BackgroundTask::start(std::function<void()> task) {
  if (started_) return false;
  started_ = background().try_start(task);
  return started_;
}

void BackgroundTask::wait() {
  if (!started_) return;
  started_ = false;
  if (std::exception_ptr failure = background().wait()) std::rethrow_exception(failure);
}

void run_shares(std::size_t shares, const std::function<void(std::size_t)>& share) {
  if (shares > 1 && pool().try_run(shares, share)) return;
  for (std::size_t t = 0; t < shares; ++t) share(t);
}

std::size_t page_threads(std::size_t n, std::size_t page_bytes, std::size_t bytes_per_thread,
                         std::size_t max_threads) {
  const std::size_t by_bytes = n * page_bytes / bytes_per_thread;
  if (by_bytes <= 1) return 1;
  // Asked once: each call is a system call (glibc's get_nprocs).
  static const auto cores =
      static_cast<std::size_t>(std::max(1u, std::thread::hardware_concurrency()));
  return std::min({by_bytes, cores, max_threads, n});
}

}  // namespace hicache::detail
