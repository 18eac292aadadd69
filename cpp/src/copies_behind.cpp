#include "copies_behind.hpp"

#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <exception>
#include <mutex>
#include <system_error>
#include <thread>
#include <utility>

namespace hicache::detail {
namespace {

// Parked on a condition variable until an owner adds jobs; runs them in the order added. Never
// destroyed (so exit never waits for it), and not used in a forked child, whose copies of its
// mutex and condition variables may be held or waited on by a thread that does not exist there.
//
// A store hands over an installment every few tens of microseconds, about as long as waking a
// parked thread takes: so while it is owned the thread spins a while for the next job before it
// parks, and the owner spins a while for the last one to end before it waits.
constexpr auto kSpin = std::chrono::microseconds(200);

class CopyThread {
 public:
  bool try_own() {
    if (::getpid() != owner_pid_) return false;
    std::lock_guard<std::mutex> g(mu_);
    if (owned_) return false;
    if (!thread_.joinable()) {
      try {
        thread_ = std::thread([this] { loop(); });
      } catch (const std::system_error&) {
        return false;
      }
    }
    owned_ = true;
    owned_now_.store(true, std::memory_order_release);
    failure_ = nullptr;
    return true;
  }

  void add(std::function<void()> job) {
    {
      std::lock_guard<std::mutex> g(mu_);
      if (failure_) return;  // an earlier job threw: the queue has ended
      jobs_.push_back(std::move(job));
      queued_.fetch_add(1, std::memory_order_release);
    }
    wake_.notify_one();
  }

  // Waits until the queue is empty and no job runs; frees the thread for the next owner.
  std::exception_ptr release() {
    spin_until([&] { return queued_.load(std::memory_order_acquire) == 0; });
    std::unique_lock<std::mutex> g(mu_);
    idle_.wait(g, [&] { return jobs_.empty() && !running_; });
    owned_ = false;
    owned_now_.store(false, std::memory_order_release);
    return std::exchange(failure_, nullptr);
  }

 private:
  template <class Done>
  static void spin_until(Done done) {
    const auto until = std::chrono::steady_clock::now() + kSpin;
    while (!done() && std::chrono::steady_clock::now() < until) std::this_thread::yield();
  }

  void loop() {
    std::unique_lock<std::mutex> g(mu_);
    for (;;) {
      if (jobs_.empty() && owned_) {  // the owner may hand over the next one soon
        g.unlock();
        spin_until([&] {
          return queued_.load(std::memory_order_acquire) > 0 ||
                 !owned_now_.load(std::memory_order_acquire);
        });
        g.lock();
      }
      wake_.wait(g, [&] { return !jobs_.empty(); });
      std::function<void()> job = std::move(jobs_.front());
      jobs_.pop_front();
      running_ = true;
      g.unlock();
      std::exception_ptr failure;
      try {
        job();
      } catch (...) {
        failure = std::current_exception();
      }
      job = nullptr;  // what it holds goes before its owner is told it ran
      g.lock();
      running_ = false;
      std::size_t ended = 1;
      if (failure && !failure_) {
        failure_ = failure;
        ended += jobs_.size();
        jobs_.clear();  // the jobs after it do not run
      }
      queued_.fetch_sub(ended, std::memory_order_release);
      if (jobs_.empty()) idle_.notify_all();
    }
  }

  std::mutex mu_;
  std::condition_variable wake_, idle_;
  std::thread thread_;
  pid_t owner_pid_ = ::getpid();
  std::deque<std::function<void()>> jobs_;
  bool running_ = false;
  bool owned_ = false;  // a CopiesBehind holds the thread (its first add() to wait())
  std::exception_ptr failure_;
  // For the spins, read without the lock: jobs added and not ended yet, and owned_.
  std::atomic<std::size_t> queued_{0};
  std::atomic<bool> owned_now_{false};
};

CopyThread& copy_thread() {
  static CopyThread* t = new CopyThread;
  return *t;
}

}  // namespace

void CopiesBehind::add(std::function<void()> job) {
  if (failed_) return;
  if (want_) {
    want_ = false;
    behind_ = copy_thread().try_own();
  }
  if (behind_) return copy_thread().add(std::move(job));
  try {
    job();
  } catch (...) {
    failed_ = true;
    failure_ = std::current_exception();
  }
}

void CopiesBehind::wait() {
  std::exception_ptr failure = std::exchange(failure_, nullptr);
  if (behind_) {
    behind_ = false;
    failure = copy_thread().release();
  }
  if (failure) {
    failed_ = true;
    std::rethrow_exception(failure);
  }
}

void CopiesBehind::drain() noexcept {
  try {
    wait();
  } catch (...) {  // the owner's own error (if any) is the one that matters now
  }
}

}  // namespace hicache::detail
