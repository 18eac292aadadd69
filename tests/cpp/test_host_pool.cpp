#include <gtest/gtest.h>

#include <cstdint>

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
