// Shared-memory regions: one owner per region, refused attachments, and no region left in
// /dev/shm by a process that exits, is terminated, or is killed.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <string>
#include <thread>

#include "hicache/error.hpp"
#include "hicache/shared_region.hpp"
#include "shared_region_lock.hpp"

namespace {

using hicache::SharedRegion;

std::string unique_name() {
  static std::atomic<int> n{0};
  return "hicache-test-region-" + std::to_string(::getpid()) + "-" + std::to_string(n++);
}

bool exists(const std::string& name) { return std::filesystem::exists("/dev/shm/" + name); }

SharedRegion region(const std::string& name, bool create, std::string owner = "engine-a",
                    std::string layout = "page_bytes=4096 slots=4") {
  return {name, create, std::move(owner), std::move(layout), 2.0};
}

// What the allocation throws, or "" if it succeeds (then it is freed).
std::string refusal(const SharedRegion& r, std::size_t bytes = 4 * 4096) {
  auto alloc = hicache::make_shared_region_allocator(r);
  try {
    void* p = alloc->allocate(bytes);
    alloc->deallocate(p, bytes);
    return "";
  } catch (const hicache::Error& e) {
    return e.what();
  }
}

// Runs `body` in a forked child, which signals readiness through a pipe and then waits to be
// stopped; returns the child's pid once it is ready.
template <typename Body>
pid_t child_holding_a_region(const std::string& name, Body body) {
  int fds[2];
  if (::pipe(fds) != 0) return -1;
  std::fflush(nullptr);  // the child must not print what the parent buffered
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::close(fds[0]);
    body();
    auto alloc = hicache::make_shared_region_allocator(region(name, true));
    alloc->allocate(4 * 4096);
    char ok = 1;
    if (::write(fds[1], &ok, 1) != 1) ::_exit(9);
    // Short sleeps, not pause(): under ThreadSanitizer a signal that arrives between the
    // write above and pause() is deferred to the next intercepted call's return, and pause()
    // then waits for another one (a CI run hung here for 30 minutes, 2026-12-05).
    for (;;) ::usleep(1000);
  }
  ::close(fds[1]);
  char ok = 0;
  const bool ready = ::read(fds[0], &ok, 1) == 1;
  ::close(fds[0]);
  return ready ? pid : -1;
}

int wait_signal(pid_t pid) {
  int status = 0;
  if (::waitpid(pid, &status, 0) != pid) return -1;
  return WIFSIGNALED(status) ? WTERMSIG(status) : -WEXITSTATUS(status) - 100;
}

}  // namespace

TEST(SharedRegion, OneCreatorAttachersOfTheSameOwnerAndLayoutOnly) {
  const SharedRegionTestLock lock;
  const std::string name = unique_name();
  auto owner = hicache::make_shared_region_allocator(region(name, true));
  auto* data = static_cast<std::uint8_t*>(owner->allocate(4 * 4096));
  data[0] = 42;
  {
    auto same = hicache::make_shared_region_allocator(region(name, false));
    auto* seen = static_cast<std::uint8_t*>(same->allocate(4 * 4096));
    EXPECT_EQ(seen[0], 42);  // one memory
    same->deallocate(seen, 4 * 4096);
  }
  // A second engine naming the region is refused, whatever it asks.
  EXPECT_NE(refusal(region(name, true)).find("in use by process " + std::to_string(::getpid())),
            std::string::npos)
      << refusal(region(name, true));
  const std::string other_owner = refusal(region(name, false, "engine-b"));
  EXPECT_NE(other_owner.find("belongs to owner 'engine-a', not 'engine-b'"), std::string::npos)
      << other_owner;
  const std::string other_layout = refusal(region(name, false, "engine-a", "page_bytes=8192"));
  EXPECT_NE(other_layout.find("holds slots of layout 'page_bytes=4096 slots=4'"), std::string::npos)
      << other_layout;
  EXPECT_NE(refusal(region(name, false), 5 * 4096).find("not the 20480 this pool needs"),
            std::string::npos);
  EXPECT_EQ(data[0], 42);  // none of them touched it
  owner->deallocate(data, 4 * 4096);
  EXPECT_TRUE(exists(name));  // the name stays while the creator's allocator lives...
  owner.reset();
  EXPECT_FALSE(exists(name));  // ...and goes with it
}

TEST(SharedRegion, AnAttacherWaitsForItsCreatorAndGivesUpWithAReason) {
  const SharedRegionTestLock lock;
  const std::string name = unique_name();
  std::thread late([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    auto owner = hicache::make_shared_region_allocator(region(name, true));
    void* p = owner->allocate(4 * 4096);
    std::this_thread::sleep_for(std::chrono::milliseconds(500));
    owner->deallocate(p, 4 * 4096);
  });
  EXPECT_EQ(refusal(region(name, false)), "");  // attached once it appeared
  late.join();
  SharedRegion quick = region(unique_name(), false);
  quick.attach_timeout_s = 0.1;
  const std::string why = refusal(quick);
  EXPECT_NE(why.find("not created after 0.1"), std::string::npos) << why;
}

TEST(SharedRegion, AKilledCreatorsRegionIsReclaimedAndRefusedToAttachers) {
  const SharedRegionTestLock lock;
  const std::string name = unique_name();
  const pid_t child = child_holding_a_region(name, [] {});
  ASSERT_GT(child, 0);
  EXPECT_TRUE(exists(name));
  const auto kept = hicache::reclaim_shared_regions();
  EXPECT_EQ(std::find(kept.begin(), kept.end(), name), kept.end());  // negative control: alive
  EXPECT_TRUE(exists(name)) << "a live creator's region was reclaimed";
  ::kill(child, SIGKILL);
  ASSERT_EQ(wait_signal(child), SIGKILL);
  EXPECT_TRUE(exists(name));  // nothing runs on SIGKILL: the region is left behind
  const std::string why = refusal(region(name, false));
  EXPECT_NE(why.find("which is gone"), std::string::npos) << why;
  const auto removed = hicache::reclaim_shared_regions();
  EXPECT_NE(std::find(removed.begin(), removed.end(), name), removed.end());
  EXPECT_FALSE(exists(name));
}

TEST(SharedRegion, ANewCreatorReplacesTheRegionOfADeadOne) {
  const SharedRegionTestLock lock;
  const std::string name = unique_name();
  const pid_t child = child_holding_a_region(name, [] {});
  ASSERT_GT(child, 0);
  ::kill(child, SIGKILL);
  ASSERT_EQ(wait_signal(child), SIGKILL);
  EXPECT_EQ(refusal(region(name, true)), "");
  EXPECT_FALSE(exists(name));
}

TEST(SharedRegion, SigtermRemovesTheRegionThenActsAsBefore) {
  const SharedRegionTestLock lock;
  // With the default action: removed, and the process still dies of SIGTERM.
  const std::string name = unique_name();
  pid_t child = child_holding_a_region(name, [] {});
  ASSERT_GT(child, 0);
  ::kill(child, SIGTERM);
  EXPECT_EQ(wait_signal(child), SIGTERM);
  EXPECT_FALSE(exists(name));
  // With the program's own handler (as Python's): removed, and that handler still runs.
  const std::string named = unique_name();
  child = child_holding_a_region(named, [] { ::signal(SIGTERM, [](int) { ::_exit(7); }); });
  ASSERT_GT(child, 0);
  ::kill(child, SIGTERM);
  EXPECT_EQ(wait_signal(child), -107);  // exited 7: the program's handler ran
  EXPECT_FALSE(exists(named));
}

TEST(SharedRegion, AnExitWithoutFreeingItRemovesItButUnderscoreExitDoesNot) {
  const SharedRegionTestLock lock;
  for (const bool clean : {true, false}) {
    const std::string name = unique_name();
    std::fflush(nullptr);  // the child must not print what the parent buffered
    const pid_t pid = ::fork();
    if (pid == 0) {
      auto* leaked = new std::shared_ptr<hicache::HostAllocator>(
          hicache::make_shared_region_allocator(region(name, true)));
      (*leaked)->allocate(4 * 4096);
      if (clean) std::exit(0);  // atexit handlers run
      ::_exit(0);               // nothing runs
    }
    ASSERT_EQ(wait_signal(pid), -100);
    EXPECT_EQ(exists(name), !clean) << (clean ? "exit" : "_exit");
    hicache::reclaim_shared_regions();
    EXPECT_FALSE(exists(name));
  }
}

// The lock the region tests hold (shared_region_lock.hpp) keeps a second holder out until the
// first lets go: without it, a test creating a region beside one that left a killed creator's
// region to inspect swept it away (seen under ctest -j2).
TEST(SharedRegionTestLock, KeepsASecondHolderOutUntilTheFirstLetsGo) {
  const int other = ::open(SharedRegionTestLock::kPath, O_RDONLY | O_CREAT | O_CLOEXEC, 0644);
  ASSERT_GE(other, 0);
  {
    const SharedRegionTestLock lock;
    ASSERT_TRUE(lock.held());
    EXPECT_NE(::flock(other, LOCK_EX | LOCK_NB), 0);
    EXPECT_EQ(errno, EWOULDBLOCK);
  }
  EXPECT_EQ(::flock(other, LOCK_EX | LOCK_NB), 0);  // negative control: free once released
  ::close(other);
}
