#include <gtest/gtest.h>
#include <sys/sysinfo.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "hicache/error.hpp"
#include "hicache/host_memory.hpp"
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

// Once every chunk is there, slot() reads the chunks without the pool's lock. Threads asking
// for slots while the background thread pins the last chunks get nullptr or the address the
// slot keeps for good, never another (ThreadSanitizer runs this too).
TEST(HostPool, SlotsKeepTheirAddressesFromEveryThreadWhileAndAfterThePoolBecomesWhole) {
  auto alloc = std::make_shared<CountingAllocator>();
  hicache::HostPool pool(1000, 64, 4096, alloc, hicache::HostPool::Growth::kBackground);
  std::vector<std::vector<std::byte*>> seen(4, std::vector<std::byte*>(64, nullptr));
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int round = 0; round < 2000; ++round) {
        const auto i = static_cast<std::int64_t>((round * 7 + t * 13) % 64);
        std::byte* p = pool.slot(i);
        if (p == nullptr) continue;
        std::byte*& first = seen[static_cast<std::size_t>(t)][static_cast<std::size_t>(i)];
        if (first == nullptr) first = p;
        ASSERT_EQ(p, first) << "slot " << i << " moved";
      }
    });
  }
  for (std::thread& th : threads) th.join();
  pool.wait_idle();
  EXPECT_EQ(pool.allocated_bytes(), pool.total_bytes());
  for (std::int64_t i = 0; i < 64; ++i) {
    std::byte* p = pool.slot(i);
    ASSERT_NE(p, nullptr);
    EXPECT_EQ(p - pool.slot(i / 4 * 4), (i % 4) * 1024) << "slot " << i;
    for (const auto& mine : seen) {
      if (mine[static_cast<std::size_t>(i)] != nullptr) {
        EXPECT_EQ(mine[static_cast<std::size_t>(i)], p) << "slot " << i;
      }
    }
  }
  EXPECT_EQ(alloc->allocations, 16);  // one allocation a chunk, none twice
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

TEST(HostPool, BackgroundModeStatusSaysWhetherItPinsWaitsOrStoppedAndWhy) {
  auto alloc = std::make_shared<GatedAllocator>();
  hicache::HostPool pool(1024, 8, 4096, alloc, hicache::HostPool::Growth::kBackground);
  auto s = pool.status();
  EXPECT_EQ(s.pinning, hicache::HostPool::Pinning::kPinning);  // chunk 1 held at the gate
  EXPECT_EQ(s.allocated_bytes, 4096u);
  EXPECT_EQ(s.total_bytes, 8192u);
  {
    std::lock_guard<std::mutex> g(alloc->mu);
    alloc->fail_next = true;
  }
  alloc->release();
  pool.wait_idle();
  s = pool.status();
  EXPECT_EQ(s.pinning, hicache::HostPool::Pinning::kStopped);
  EXPECT_EQ(s.note, "planned pinning failure");
  EXPECT_STREQ(hicache::HostPool::name(s.pinning), "stopped");
  EXPECT_THROW(pool.slot(4), hicache::Error);
  EXPECT_EQ(pool.slot(4), nullptr);  // asked for: allocated, and the sweep goes on
  pool.wait_idle();
  s = pool.status();
  EXPECT_EQ(s.pinning, hicache::HostPool::Pinning::kWhole);
  EXPECT_EQ(s.allocated_bytes, 8192u);
  EXPECT_EQ(s.note, "planned pinning failure");  // the last failure stays on record

  hicache::HostPool lazy(1024, 8, 4096, hicache::make_aligned_host_allocator());
  EXPECT_EQ(lazy.status().pinning, hicache::HostPool::Pinning::kOnDemand);
  lazy.slot(0);
  lazy.slot(7);
  EXPECT_EQ(lazy.status().pinning, hicache::HostPool::Pinning::kWhole);
  // Capacities meaning "unbounded" do not overflow the pool's size.
  hicache::HostPool huge(1 << 20, INT64_MAX, 1 << 30, hicache::make_aligned_host_allocator());
  EXPECT_EQ(huge.status().total_bytes, SIZE_MAX);
}

namespace {

// An allocator on a machine with no memory to spare: room_for is false until told otherwise.
class NoRoomAllocator : public hicache::HostAllocator {
 public:
  void* allocate(std::size_t bytes) override { return inner->allocate(bytes); }
  void deallocate(void* p, std::size_t n) noexcept override { inner->deallocate(p, n); }
  const char* name() const override { return "no room"; }
  bool allocation_is_slow() const override { return true; }
  bool room_for(std::size_t) const override { return room; }
  std::string memory_report() const override { return "0.5 GiB available of 8.0 GiB"; }
  std::shared_ptr<hicache::HostAllocator> inner = hicache::make_aligned_host_allocator();
  std::atomic<bool> room = false;
};

}  // namespace

TEST(HostPool, ASweepWaitingForMemorySaysSoAndGoesOnOnceThereIsRoom) {
  auto alloc = std::make_shared<NoRoomAllocator>();
  hicache::HostPool pool(1024, 16, 4096, alloc, hicache::HostPool::Growth::kBackground);
  pool.wait_idle();
  auto s = pool.status();
  EXPECT_EQ(s.pinning, hicache::HostPool::Pinning::kWaitingForMemory);
  EXPECT_EQ(s.allocated_bytes, 4096u);
  EXPECT_EQ(s.note, "too little host memory to pin ahead of need: 0.5 GiB available of 8.0 GiB");
  alloc->room = true;
  for (int i = 0; i < 5000 && pool.status().pinning != hicache::HostPool::Pinning::kWhole; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  s = pool.status();
  EXPECT_EQ(s.pinning, hicache::HostPool::Pinning::kWhole);
  EXPECT_EQ(s.allocated_bytes, 16384u);
  EXPECT_EQ(s.note, "");
}

// --- reading the machine's memory
// -----------------------------------------------------------------

TEST(HostMemory, ParsesMeminfoLineByLineWhateverTheOtherLinesHold) {
  // Lines without a unit (HugePages_*) before and after the two that count, as some kernels
  // order them; the values are in KiB.
  const std::string text =
      "HugePages_Total:       0\n"
      "MemTotal:       131961788 kB\n"
      "MemFree:        128885952 kB\n"
      "MemAvailable:   131300672 kB\n"
      "HugePages_Free:        0\n"
      "Hugepagesize:       2048 kB\n";
  const auto m = hicache::parse_meminfo(text);
  ASSERT_TRUE(m);
  EXPECT_EQ(m->total, std::size_t{131961788} << 10);
  EXPECT_EQ(m->available, std::size_t{131300672} << 10);
  EXPECT_EQ(hicache::describe(*m), "125.2 GiB available of 125.8 GiB");
  EXPECT_EQ(hicache::host_memory_reserve(*m), (std::size_t{131961788} << 10) / 32);
}

TEST(HostMemory, RefusesReadingsThatCannotBeTrue) {
  using hicache::parse_meminfo;
  EXPECT_FALSE(parse_meminfo(""));
  EXPECT_FALSE(parse_meminfo("MemTotal: 1000 kB\n"));                       // no MemAvailable
  EXPECT_FALSE(parse_meminfo("MemTotal: 0 kB\nMemAvailable: 0 kB\n"));      // zeros
  EXPECT_FALSE(parse_meminfo("MemTotal: 100 kB\nMemAvailable: 200 kB\n"));  // more than all
  EXPECT_FALSE(parse_meminfo("MemTotal: x kB\nMemAvailable: 10 kB\n"));     // not a number
  EXPECT_FALSE(parse_meminfo("MemTotal: 100 MB\nMemAvailable: 10 MB\n"));   // another unit
  EXPECT_FALSE(parse_meminfo("MemTotal: 99999999999999999999 kB\nMemAvailable: 1 kB\n"));
  EXPECT_TRUE(parse_meminfo("MemTotal: 100 kB\nMemAvailable: 10 kB"));  // no final newline
}

TEST(HostMemory, ReadsThisMachinesMemoryAsTheKernelCountsIt) {
  // The real reader against sysinfo(2), which counts the same pages: MemTotal is exact.
  const auto m = hicache::read_host_memory();
  ASSERT_TRUE(m) << "/proc/meminfo could not be read or parsed";
  struct sysinfo si{};
  ASSERT_EQ(sysinfo(&si), 0);
  EXPECT_EQ(m->total, static_cast<std::size_t>(si.totalram) * si.mem_unit);
  EXPECT_GT(m->available, 0u);
  EXPECT_LE(m->available, m->total);
  EXPECT_TRUE(hicache::make_aligned_host_allocator()->room_for(1)) << "a machine with no room?";
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

TEST(HostPool, SlotsTakeATiersAlignmentOnlyWhereItCostsLittle) {
  auto memory = hicache::make_aligned_host_allocator();
  // A 1 MiB page and a 320-byte record: 4096-aligned slots add 3776 bytes (1/278 of a slot).
  hicache::HostPool big((1 << 20) + 320, 8, 4 << 20, memory, hicache::HostPool::Growth::kOnDemand,
                        4096);
  EXPECT_EQ(big.slot_align(), 4096u);
  EXPECT_EQ(big.slot_stride(), (1u << 20) + 4096);
  for (std::int64_t i = 0; i < 8; ++i) {
    EXPECT_EQ(reinterpret_cast<std::uintptr_t>(big.slot(i)) % 4096, 0u) << i;
  }
  // A 4 KiB page and its record: 4096-aligned slots would add 3776 bytes to 4416 (negative
  // control: the pool keeps 256).
  hicache::HostPool small(4096 + 320, 8, 1 << 20, memory, hicache::HostPool::Growth::kOnDemand,
                          4096);
  EXPECT_EQ(small.slot_align(), hicache::HostPool::kSlotAlign);
  EXPECT_EQ(small.slot_stride(), 4096u + 512);
  hicache::HostPool plain((1 << 20) + 320, 8, 4 << 20, memory);
  EXPECT_EQ(plain.slot_stride(), (1u << 20) + 512);
  EXPECT_THROW(
      hicache::HostPool(4096, 8, 1 << 20, memory, hicache::HostPool::Growth::kOnDemand, 3000),
      std::invalid_argument);
}

TEST(HostPool, TheAlignedAllocatorMapsLargeChunksOnHugePageBoundaries) {
  // Chunks of 2 MiB and more start at a 2 MiB boundary, asked to be on huge pages (whether the
  // kernel gives them is its choice: not asserted), zeroed and writable to their last byte;
  // smaller ones keep 4 KiB alignment. (aligned_alloc's large chunks, the allocator before,
  // fail the first check here.)
  auto alloc = hicache::make_aligned_host_allocator();
  constexpr std::size_t kHuge = std::size_t{2} << 20;
  for (const std::size_t bytes : {kHuge, 3 * kHuge + 4096 + 17}) {
    auto* p = static_cast<unsigned char*>(alloc->allocate(bytes));
    EXPECT_EQ(reinterpret_cast<std::uintptr_t>(p) % kHuge, 0u) << bytes;
    EXPECT_EQ(p[0], 0);
    EXPECT_EQ(p[bytes - 1], 0);
    for (std::size_t i = 0; i < bytes; i += 4096) p[i] = 1;
    p[bytes - 1] = 1;
    alloc->deallocate(p, bytes);
  }
  auto* small = static_cast<unsigned char*>(alloc->allocate(10000));
  EXPECT_EQ(reinterpret_cast<std::uintptr_t>(small) % 4096, 0u);
  small[9999] = 1;
  alloc->deallocate(small, 10000);
}

namespace {

// Hands out one buffer end to end, each allocation starting where the last one ended (as mmap
// does in a bottom-up address-space layout), and remembers what it was asked for.
class EndToEndAllocator : public hicache::HostAllocator {
 public:
  void* allocate(std::size_t bytes) override {
    if (used + bytes > buffer.size()) throw hicache::Error("end-to-end buffer exhausted");
    void* p = buffer.data() + used;
    used += bytes;
    asked.push_back(bytes);
    return p;
  }
  void deallocate(void*, std::size_t bytes) noexcept override { returned.push_back(bytes); }
  const char* name() const override { return "end to end"; }
  std::vector<std::byte> buffer = std::vector<std::byte>(1 << 20);
  std::size_t used = 0;
  std::vector<std::size_t> asked, returned;
};

}  // namespace

// The staged path joins host slots that follow each other in memory into one DMA piece; a piece
// across two chunks would span two pinned registrations. However the allocator places chunks,
// the pool leaves kChunkGap bytes after each chunk's last slot, so no slot of one chunk ends
// where a slot of another begins.
TEST(HostPool, NoSlotOfOneChunkEndsWhereASlotOfAnotherBegins) {
  auto alloc = std::make_shared<EndToEndAllocator>();
  {
    // Negative control: this allocator does place allocations end to end.
    auto* a = static_cast<std::byte*>(alloc->allocate(2048));
    auto* b = static_cast<std::byte*>(alloc->allocate(2048));
    ASSERT_EQ(a + 2048, b);
    alloc->deallocate(a, 2048);
    alloc->deallocate(b, 2048);
  }
  alloc->asked.clear();
  alloc->returned.clear();
  {
    hicache::HostPool pool(1000, 10, 2048, alloc);  // stride 1024: 2 slots a chunk, 5 chunks
    ASSERT_EQ(pool.slot_stride(), 1024u);
    std::vector<std::byte*> slots;
    for (std::int64_t i = 0; i < 10; ++i) slots.push_back(pool.slot(i));
    for (std::int64_t i = 0; i < 10; ++i) {
      for (std::int64_t j = 0; j < 10; ++j) {
        if (i / 2 == j / 2) continue;  // the same chunk: adjacent slots are expected there
        EXPECT_NE(slots[i] + pool.slot_stride(), slots[j]) << "slot " << i << " runs into " << j;
      }
    }
    EXPECT_EQ(slots[1], slots[0] + 1024);           // within a chunk, slots still follow each other
    EXPECT_EQ(pool.allocated_bytes(), 10u * 1024);  // the pool's bytes: the gaps are not slots
    ASSERT_EQ(alloc->asked.size(), 5u);
    for (std::size_t bytes : alloc->asked) {
      EXPECT_EQ(bytes, 2048 + hicache::HostPool::kChunkGap);
    }
  }
  ASSERT_EQ(alloc->returned.size(), 5u);  // each chunk given back with the size it was asked
  for (std::size_t bytes : alloc->returned) {
    EXPECT_EQ(bytes, 2048 + hicache::HostPool::kChunkGap);
  }
  // A pool of one chunk has no other chunk to touch: it asks for its bytes alone (a shared
  // region's size, which every process attaching to it checks, stays the pool's).
  alloc->asked.clear();
  alloc->returned.clear();
  {
    hicache::HostPool one(1000, 4, 1 << 20, alloc);
    one.slot(3);
  }
  EXPECT_EQ(alloc->asked, std::vector<std::size_t>{4096});
  EXPECT_EQ(alloc->returned, std::vector<std::size_t>{4096});
}
