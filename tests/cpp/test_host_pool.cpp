#include <gtest/gtest.h>

#include <condition_variable>
#include <cstdint>
#include <mutex>

#include "hicache/error.hpp"
#include "hicache/host_pool.hpp"

namespace {

class CountingAllocator : public hicache::HostAllocator {
 public:
  void* allocate(std::size_t bytes) override {
    if (fail) throw hicache::Error("planned allocation failure");
    ++allocations;
    live += bytes;
    return inner->allocate(bytes);
  }
  void deallocate(void* p, std::size_t bytes) noexcept override {
    live -= bytes;
    inner->deallocate(p, bytes);
  }
  const char* name() const override { return "counting"; }
  std::shared_ptr<hicache::HostAllocator> inner = hicache::make_aligned_host_allocator();
  int allocations = 0;
  std::size_t live = 0;
  bool fail = false;
};

}  // namespace

TEST(HostPool, AllocatesNothingUntilASlotIsUsedThenOneChunkAtATime) {
  auto alloc = std::make_shared<CountingAllocator>();
  {
    hicache::HostPool pool(1000, 10, 4096, alloc);  // stride 1024: 4 slots a chunk, 3 chunks
    EXPECT_EQ(pool.slot_stride(), 1024u);
    EXPECT_EQ(pool.allocated_bytes(), 0u);
    EXPECT_EQ(alloc->allocations, 0);
    std::byte* s0 = pool.slot(0);
    std::byte* s3 = pool.slot(3);
    EXPECT_EQ(alloc->allocations, 1);
    EXPECT_EQ(s3 - s0, 3 * 1024);
    pool.slot(9);  // last chunk holds only 2 slots: no rounding waste
    EXPECT_EQ(alloc->allocations, 2);
    EXPECT_EQ(pool.allocated_bytes(), 4096u + 2048u);
    EXPECT_EQ(reinterpret_cast<std::uintptr_t>(s0) % hicache::HostPool::kSlotAlign, 0u);
  }
  EXPECT_EQ(alloc->live, 0u);  // everything returned
}

TEST(HostPool, RejectsSlotsOutsideThePool) {
  hicache::HostPool pool(64, 4, 1 << 20, hicache::make_aligned_host_allocator());
  EXPECT_THROW(pool.slot(-1), std::out_of_range);
  EXPECT_THROW(pool.slot(4), std::out_of_range);
}

TEST(HostPool, AllocationFailureIsAHicacheErrorAndLeavesThePoolUsable) {
  auto alloc = std::make_shared<CountingAllocator>();
  hicache::HostPool pool(64, 4, 64, alloc);
  alloc->fail = true;
  EXPECT_THROW(pool.slot(0), hicache::Error);
  alloc->fail = false;
  EXPECT_NE(pool.slot(0), nullptr);
}

namespace {

// Models pinning: allocation waits until the test opens the gate (as cudaHostRegister waits for
// the GPU's queued work).
class GatedAllocator : public hicache::HostAllocator {
 public:
  void* allocate(std::size_t bytes) override {
    std::unique_lock<std::mutex> lock(mu);
    ++calls;
    if (calls > 1) cv.wait(lock, [&] { return open; });
    if (fail_next) {
      fail_next = false;
      throw hicache::Error("planned pinning failure");
    }
    return inner->allocate(bytes);
  }
  void deallocate(void* p, std::size_t bytes) noexcept override { inner->deallocate(p, bytes); }
  const char* name() const override { return "gated"; }
  bool allocation_is_slow() const override { return true; }
  void release() {
    std::lock_guard<std::mutex> g(mu);
    open = true;
    cv.notify_all();
  }
  std::shared_ptr<hicache::HostAllocator> inner = hicache::make_aligned_host_allocator();
  std::mutex mu;
  std::condition_variable cv;
  int calls = 0;
  bool open = false;
  bool fail_next = false;
};

}  // namespace

TEST(HostPool, BackgroundModeAllocatesTheFirstChunkUpFrontAndTheRestInTheBackground) {
  auto alloc = std::make_shared<GatedAllocator>();
  hicache::HostPool pool(1024, 8, 4096, alloc, hicache::HostPool::Growth::kBackground);
  EXPECT_EQ(pool.allocated_bytes(), 4096u);  // chunk 0, by the constructor
  EXPECT_NE(pool.slot(0), nullptr);          // chunk 1 is being allocated (held at the gate)
  EXPECT_EQ(pool.slot(4), nullptr);          // not there yet: never blocks
  alloc->release();
  pool.wait_idle();
  EXPECT_NE(pool.slot(4), nullptr);
  EXPECT_EQ(pool.allocated_bytes(), 8192u);
}

TEST(HostPool, BackgroundModeReportsAFailureOnceThenAllocatesWhenAskedAgain) {
  auto alloc = std::make_shared<GatedAllocator>();
  hicache::HostPool pool(1024, 8, 4096, alloc, hicache::HostPool::Growth::kBackground);
  {
    std::lock_guard<std::mutex> g(alloc->mu);
    alloc->fail_next = true;  // the background allocation of chunk 1 fails
  }
  alloc->release();
  pool.wait_idle();                            // it has failed; the sweep stops there
  EXPECT_THROW(pool.slot(4), hicache::Error);  // the failure, reported once
  EXPECT_EQ(pool.slot(4), nullptr);            // asked again, in the background
  pool.wait_idle();
  EXPECT_NE(pool.slot(4), nullptr);
  EXPECT_EQ(pool.allocated_bytes(), 8192u);
}
