// The copy thread behind a store's walk (copies_behind.hpp): jobs run in order on one thread of
// their own, beside the caller, one owner at a time; a job that throws ends the queue.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <mutex>
#include <stdexcept>
#include <thread>
#include <vector>

#include "copies_behind.hpp"

namespace {

using hicache::detail::CopiesBehind;

// Jobs that note their order and thread; the first waits (up to 5 s) for the caller to say it
// went on past add(), which only a job behind the caller can see.
struct Log {
  std::mutex mu;
  std::vector<int> order;
  std::vector<std::thread::id> threads;
  std::atomic<bool> caller_went_on{false};
  bool first_saw_caller_go_on = false;
  void note(int i) {
    std::lock_guard<std::mutex> g(mu);
    order.push_back(i);
    threads.push_back(std::this_thread::get_id());
  }
};

void add_jobs(CopiesBehind& q, Log& log, int n) {
  q.add([&log] {
    const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(5000);
    while (!log.caller_went_on && std::chrono::steady_clock::now() < until) {
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
    log.first_saw_caller_go_on = log.caller_went_on;
    log.note(0);
  });
  log.caller_went_on = true;
  for (int i = 1; i < n; ++i) q.add([&log, i] { log.note(i); });
}

}  // namespace

TEST(CopiesBehind, JobsRunInOrderOnOneThreadBesideTheCaller) {
  Log log;
  CopiesBehind q(true);
  add_jobs(q, log, 50);
  EXPECT_TRUE(q.behind());
  q.wait();
  EXPECT_FALSE(q.behind());
  ASSERT_EQ(log.order.size(), 50u);
  for (int i = 0; i < 50; ++i) EXPECT_EQ(log.order[i], i);
  EXPECT_TRUE(log.first_saw_caller_go_on) << "add() waited for the job";
  for (const auto& t : log.threads) {
    EXPECT_NE(t, std::this_thread::get_id());
    EXPECT_EQ(t, log.threads[0]);
  }
}

TEST(CopiesBehind, NotBehindEveryJobRunsInAdd) {
  // The control: a job runs on the caller, before add() returns.
  Log log;
  CopiesBehind q(false);
  q.add([&log] { log.note(0); });
  EXPECT_EQ(log.order.size(), 1u);
  EXPECT_FALSE(q.behind());
  q.wait();
  EXPECT_EQ(log.threads[0], std::this_thread::get_id());
}

TEST(CopiesBehind, OneOwnerAtATimeTheNextRunsItsJobsItselfThenTakesTheThreadOnceFree) {
  Log first, second;
  CopiesBehind a(true);
  a.add([] {});
  ASSERT_TRUE(a.behind());
  {
    CopiesBehind b(true);
    b.add([&second] { second.note(0); });  // the thread is a's: b runs it here
    EXPECT_FALSE(b.behind());
    b.wait();
  }
  ASSERT_EQ(second.threads.size(), 1u);
  EXPECT_EQ(second.threads[0], std::this_thread::get_id());
  a.wait();
  CopiesBehind c(true);
  add_jobs(c, first, 3);
  EXPECT_TRUE(c.behind()) << "the thread was not freed by a.wait()";
  c.wait();
  EXPECT_TRUE(first.first_saw_caller_go_on);
}

TEST(CopiesBehind, AJobThatThrowsEndsTheQueueAndReachesWait) {
  for (const bool behind : {true, false}) {
    SCOPED_TRACE(behind ? "behind" : "on the caller");
    Log log;
    CopiesBehind q(behind);
    q.add([&log] { log.note(0); });
    q.add([] { throw std::runtime_error("job 1 failed"); });
    q.add([&log] { log.note(2); });
    EXPECT_THROW(
        {
          try {
            q.wait();
          } catch (const std::runtime_error& e) {
            EXPECT_STREQ(e.what(), "job 1 failed");
            throw;
          }
        },
        std::runtime_error);
    EXPECT_EQ(log.order, std::vector<int>{0}) << "a job after the one that threw ran";
  }
  // The thread goes on for the next owner.
  Log log;
  CopiesBehind q(true);
  add_jobs(q, log, 2);
  EXPECT_TRUE(q.behind());
  q.wait();
  EXPECT_EQ(log.order, (std::vector<int>{0, 1}));
}

TEST(CopiesBehind, AForkedChildRunsItsJobsItself) {
  {
    CopiesBehind warm(true);  // the parent's thread exists before the fork
    warm.add([] {});
    warm.wait();
  }
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    CopiesBehind q(true);
    std::thread::id ran;
    q.add([&ran] { ran = std::this_thread::get_id(); });
    q.wait();
    ::_exit(!q.behind() && ran == std::this_thread::get_id() ? 0 : 1);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0);
}
