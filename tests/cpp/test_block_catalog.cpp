// The split API: BlockCatalog (index half) and SlotMover (copier half), within one process and
// across two sharing host memory.

#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <numeric>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "first_repeat.hpp"
#include "hicache/block_catalog.hpp"
#include "hicache/error.hpp"
#include "hicache/shared_region.hpp"
#include "hicache/slot_mover.hpp"
#include "hicache/trace_replay.hpp"
#include "shared_region_lock.hpp"

namespace {

using hicache::BlockCatalog;
using hicache::Key;

std::vector<Key> keys(std::uint64_t first, int n) {
  std::vector<Key> out;
  for (int i = 0; i < n; ++i)
    out.push_back(hicache::replay_key(first + static_cast<std::uint64_t>(i), 0));
  return out;
}

hicache::CatalogOptions opts(std::int64_t slots,
                             hicache::Admission a = hicache::Admission::kAlways) {
  hicache::CatalogOptions o;
  o.capacity_slots = slots;
  o.admission = a;
  return o;
}

}  // namespace

TEST(BlockCatalog, StoreThenLoadFollowsTheLifecycle) {
  BlockCatalog cat(opts(8));
  const auto k = keys(1, 3);
  EXPECT_EQ(cat.lookup(k[0]), BlockCatalog::Lookup::kMiss);
  const auto plan = cat.prepare_store(k, std::nullopt);
  ASSERT_EQ(plan.accepted, (std::vector<std::size_t>{0, 1, 2}));
  EXPECT_EQ(plan.slots.size(), 3u);
  EXPECT_EQ(cat.lookup(k[0]), BlockCatalog::Lookup::kPending);  // not loadable yet
  EXPECT_THROW(cat.prepare_load(k), std::invalid_argument);
  // Offered again while pending: nothing new to store.
  EXPECT_TRUE(cat.prepare_store(k, std::nullopt).accepted.empty());
  cat.complete_store(k, true);
  EXPECT_EQ(cat.lookup(k[2]), BlockCatalog::Lookup::kHit);
  const auto slots = cat.prepare_load(k);
  EXPECT_EQ(slots, plan.slots);
  cat.complete_load(k);
  EXPECT_THROW(cat.complete_load(k), std::invalid_argument);  // not pinned any more
  const auto ev = cat.take_events();
  EXPECT_EQ(ev.stored.size(), 3u);
  EXPECT_TRUE(ev.removed.empty());
  EXPECT_TRUE(cat.take_events().stored.empty());
  const auto s = cat.stats();
  EXPECT_EQ(s.blocks_stored, 3);
  EXPECT_EQ(s.blocks_loaded, 3);
  EXPECT_EQ(s.used, 3);
}

TEST(BlockCatalog, AFailedStoreIsRemovedAndReported) {
  BlockCatalog cat(opts(4));
  const auto k = keys(10, 2);
  cat.prepare_store(k, std::nullopt);
  cat.complete_store(k, false);
  EXPECT_EQ(cat.lookup(k[0]), BlockCatalog::Lookup::kMiss);
  EXPECT_EQ(cat.take_events().removed.size(), 2u);
  EXPECT_THROW(cat.complete_store(k, true), std::invalid_argument);
}

TEST(BlockCatalog, EvictsLeafFirstNeverAPinnedBlockAndReportsWhatWent) {
  BlockCatalog cat(opts(4));
  const auto a = keys(100, 3);  // a chain of three
  cat.prepare_store(a, std::nullopt);
  cat.complete_store(a, true);
  const auto pinned = cat.prepare_load(std::span<const Key>(a).first(1));  // a[0] held
  const auto b = keys(200, 2);
  const auto plan = cat.prepare_store(b, std::nullopt);
  // One free slot, then one eviction: the chain's leaf a[2], never a[0] (pinned) or a[1] (a
  // parent of a cached block).
  ASSERT_EQ(plan.accepted.size(), 2u);
  ASSERT_EQ(plan.evicted.size(), 1u);
  EXPECT_EQ(plan.evicted[0], a[2]);
  EXPECT_EQ(cat.lookup(a[0]), BlockCatalog::Lookup::kHit);
  // Every slot held now (a[0] pinned, b pending, a[1] a parent... evictable once a leaf): the
  // next store evicts a[1] (now a leaf), then runs out of room.
  const auto c = keys(300, 3);
  const auto plan2 = cat.prepare_store(c, std::nullopt);
  EXPECT_EQ(plan2.accepted.size(), 1u);
  EXPECT_EQ(plan2.evicted, (std::vector<Key>{a[1]}));
  EXPECT_EQ(cat.stats().blocks_no_room, 2);
  (void)pinned;
}

TEST(BlockCatalog, AStoreNeverEvictsTheCachedBlocksItExtends) {
  // One slot holding k0; storing [k0, k1] must not evict k0 (a leaf until k1 exists) to make
  // room for its own child: k1 finds no room, k0 stays.
  BlockCatalog cat(opts(1));
  const auto k = keys(1, 2);
  cat.prepare_store(std::span<const Key>(k).first(1), std::nullopt);
  cat.complete_store(std::span<const Key>(k).first(1), true);
  const auto plan = cat.prepare_store(k, std::nullopt);
  EXPECT_TRUE(plan.accepted.empty());
  EXPECT_TRUE(plan.evicted.empty());
  EXPECT_EQ(cat.lookup(k[0]), BlockCatalog::Lookup::kHit);
  EXPECT_EQ(cat.stats().blocks_no_room, 1);
}

TEST(BlockCatalog, SecondSightingAdmissionDeclinesAFirstOfferWhenFull) {
  BlockCatalog cat(opts(2, hicache::Admission::kSecondSighting));
  const auto a = keys(1, 2);
  cat.complete_store(
      std::span<const Key>(a).first(cat.prepare_store(a, std::nullopt).accepted.size()), true);
  const auto b = keys(50, 2);
  EXPECT_TRUE(cat.prepare_store(b, std::nullopt).accepted.empty());  // seen once: declined
  EXPECT_EQ(cat.stats().blocks_declined, 2);
  EXPECT_EQ(cat.prepare_store(b, std::nullopt).accepted.size(), 2u);  // seen twice: stored
}

TEST(BlockCatalog, ABadCapacityIsNamed) {
  try {
    BlockCatalog cat(opts(0));
    FAIL();
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("capacity_slots"), std::string::npos);
  }
}

namespace {

struct Engine {  // two layer-major segments of 4 blocks
  std::vector<std::uint8_t> k = std::vector<std::uint8_t>(4 * 64),
                            v = std::vector<std::uint8_t>(4 * 32);
  std::vector<hicache::Segment> segments() {
    return {{k.data(), 4, 64, 64}, {v.data(), 4, 32, 32}};
  }
};

}  // namespace

TEST(SlotMover, CopiesPagesToSlotsAndBackAsJobs) {
  Engine eng;
  std::iota(eng.k.begin(), eng.k.end(), 0);
  std::iota(eng.v.begin(), eng.v.end(), 100);
  hicache::SlotMover mover(eng.segments(), {hicache::DeviceKind::kCpu, 0}, 8);
  const std::vector<std::int64_t> slots{5, 2}, blocks{1, 3};
  const auto job = mover.submit(hicache::Direction::kToHost, slots, blocks);
  EXPECT_GT(job, 0);
  const auto done = mover.finished();
  ASSERT_EQ(done.size(), 1u);
  EXPECT_EQ(done[0].job, job);
  EXPECT_TRUE(done[0].ok);
  EXPECT_EQ(std::memcmp(mover.slot_address(5), eng.k.data() + 64, 64), 0);
  EXPECT_EQ(std::memcmp(mover.slot_address(5) + 64, eng.v.data() + 32, 32), 0);
  std::fill(eng.k.begin(), eng.k.end(), 0);
  std::fill(eng.v.begin(), eng.v.end(), 0);
  const std::vector<std::int64_t> back{0, 2};  // slot 5 -> block 0, slot 2 -> block 2
  mover.wait(std::vector<std::int64_t>{mover.submit(hicache::Direction::kToDevice, slots, back)});
  EXPECT_EQ(eng.k[0], 64);  // block 1's first byte, now in block 0
  EXPECT_EQ(eng.v[2 * 32], 100 + 3 * 32);
  EXPECT_THROW(mover.submit(hicache::Direction::kToHost, std::vector<std::int64_t>{8},
                            std::vector<std::int64_t>{0}),
               std::out_of_range);
  EXPECT_THROW(mover.submit(hicache::Direction::kToHost, std::vector<std::int64_t>{1, 1},
                            std::vector<std::int64_t>{0, 1}),
               std::invalid_argument);
  EXPECT_THROW(mover.submit(hicache::Direction::kToDevice, std::vector<std::int64_t>{1},
                            std::vector<std::int64_t>{4}),
               std::out_of_range);
}

TEST(SlotMover, RefusesADestinationNamedTwiceAndTheFirstBadSlotNamesTheError) {
  Engine eng;
  hicache::SlotMover mover(eng.segments(), {hicache::DeviceKind::kCpu, 0}, 8);
  using V = std::vector<std::int64_t>;
  const auto error = [&](hicache::Direction dir, const V& slots, const V& blocks) -> std::string {
    try {
      mover.submit(dir, slots, blocks);
    } catch (const std::out_of_range& e) {
      return std::string("out_of_range: ") + e.what();
    } catch (const std::invalid_argument& e) {
      return std::string("invalid_argument: ") + e.what();
    }
    return "";
  };
  const auto to_host = hicache::Direction::kToHost, to_device = hicache::Direction::kToDevice;
  EXPECT_EQ(error(to_host, V{3, 6, 0, 6, 2}, V{0, 1, 2, 3, 0}),
            "invalid_argument: submit: slot 6 is a destination twice");
  // In order, the first bad slot decides: a repeat before a slot outside the pool, and after.
  EXPECT_EQ(error(to_host, V{1, 1, 8}, V{0, 1, 2}),
            "invalid_argument: submit: slot 1 is a destination twice");
  EXPECT_EQ(error(to_host, V{8, 1, 1}, V{0, 1, 2}),
            "out_of_range: submit: slot 8 (index 0) is outside [0, 8)");
  // Loads read a slot as often as asked, but write each block once.
  EXPECT_EQ(error(to_device, V{1, 1}, V{0, 1}), "");
  EXPECT_EQ(error(to_device, V{1, 2, 3}, V{0, 3, 3}),
            "invalid_argument: submit: blocks: block id 3 appears twice; each page needs its own "
            "block");
  EXPECT_EQ(error(to_host, V{1, 2}, V{3, 3}), "");  // stores read a block as often as asked
  // Only the two good calls made jobs: nothing was enqueued by a refused one.
  mover.wait(std::vector<std::int64_t>{});
  EXPECT_EQ(mover.finished().size(), 2u);
}

// first_repeat finds where a list first names an id it named before, as a set would, over runs
// of consecutive ids (as engines hand out blocks), random ids and ids that share their hash's
// low bits.
TEST(FirstRepeat, FindsTheFirstRepeatedIdAsASetWould) {
  std::mt19937_64 rng(3);
  for (int trial = 0; trial < 600; ++trial) {
    const std::size_t n = rng() % 3000;
    std::vector<std::int64_t> ids(n);
    const int kind = trial % 3;
    for (std::size_t i = 0; i < n; ++i) {
      ids[i] = kind == 0   ? static_cast<std::int64_t>(i + 1000)
               : kind == 1 ? static_cast<std::int64_t>(rng() % (4 * n + 1))
                           : static_cast<std::int64_t>(i) << 40;
    }
    if (n > 1 && rng() % 2 == 0) ids[rng() % n] = ids[rng() % n];  // maybe a repeat
    std::set<std::int64_t> seen;
    std::optional<std::size_t> expected;
    for (std::size_t i = 0; i < n && !expected; ++i) {
      if (!seen.insert(ids[i]).second) expected = i;
    }
    ASSERT_EQ(hicache::detail::first_repeat(ids), expected) << "trial " << trial << ", " << n;
  }
}

TEST(SlotMover, TwoProcessesSharingHostMemorySeeEachOthersSlots) {
  const SharedRegionTestLock lock;  // its region's creation sweeps dead ones: none beside it
  const std::string name = "hicache-test-" + std::to_string(::getpid());
  Engine eng;
  std::iota(eng.k.begin(), eng.k.end(), 7);
  std::iota(eng.v.begin(), eng.v.end(), 9);
  const std::string layout = "page_bytes=96 slots=16";
  auto memory = hicache::make_shared_region_allocator({name, true, "catalog-1", layout});
  hicache::SlotMover writer(eng.segments(), {hicache::DeviceKind::kCpu, 0}, 16, nullptr, memory);
  writer.wait(std::vector<std::int64_t>{writer.submit(
      hicache::Direction::kToHost, std::vector<std::int64_t>{11}, std::vector<std::int64_t>{2})});
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {  // another process: maps the same memory, loads slot 11 into its block 0
    int rc = 1;
    try {
      Engine mine;
      hicache::SlotMover reader(
          mine.segments(), {hicache::DeviceKind::kCpu, 0}, 16, nullptr,
          hicache::make_shared_region_allocator({name, false, "catalog-1", layout}));
      reader.wait(std::vector<std::int64_t>{reader.submit(hicache::Direction::kToDevice,
                                                          std::vector<std::int64_t>{11},
                                                          std::vector<std::int64_t>{0})});
      const bool same = std::memcmp(mine.k.data(), eng.k.data() + 2 * 64, 64) == 0 &&
                        std::memcmp(mine.v.data(), eng.v.data() + 2 * 32, 32) == 0;
      rc = same ? 0 : 2;
    } catch (...) {
      rc = 3;
    }
    ::_exit(rc);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0);
  // Negative control: a process opening a pool of another size is refused, not misread.
  Engine other;
  hicache::SlotMover wrong(
      other.segments(), {hicache::DeviceKind::kCpu, 0}, 17, nullptr,
      hicache::make_shared_region_allocator({name, false, "catalog-1", "page_bytes=96 slots=17"}));
  EXPECT_THROW(wrong.submit(hicache::Direction::kToHost, std::vector<std::int64_t>{0},
                            std::vector<std::int64_t>{0}),
               hicache::Error);
}
