// The disk tier: values round-trip and survive a restart or a kill; a torn, damaged, truncated
// or foreign file is a miss, never a wrong value; capacity holds with pages in use kept; one
// writer a directory.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "hicache/hicache.hpp"
#include "test_support.hpp"

namespace {

namespace fs = std::filesystem;
using hicache::DiskTier;
using hicache::DiskTierOptions;
using hicache::Tier;

// A directory of its own under the system's temporary directory, removed afterwards.
struct TempDir {
  fs::path path;
  TempDir() {
    static std::atomic<int> n{0};
    path = fs::temp_directory_path() /
           ("hicache-disk-test-" + std::to_string(::getpid()) + "-" + std::to_string(n++));
    fs::remove_all(path);
  }
  ~TempDir() { fs::remove_all(path); }
};

DiskTierOptions options(const TempDir& d, std::int64_t capacity = 64 << 20,
                        std::int64_t segment = 0) {
  DiskTierOptions o;
  o.path = d.path.string();
  o.capacity_bytes = capacity;
  o.segment_bytes = segment;
  return o;
}

std::vector<std::int64_t> results(Tier& t, std::int64_t batch) {
  for (;;) {
    t.wait(batch, std::chrono::seconds(1));
    if (auto r = t.poll(batch)) return *r;
  }
}

std::vector<std::byte> value(int seed, std::size_t n) {
  std::vector<std::byte> v(n);
  std::mt19937 rng(static_cast<std::uint32_t>(seed));
  for (auto& b : v) b = static_cast<std::byte>(rng());
  return v;
}

std::string name(int i) { return "hicache/space/" + std::to_string(i); }

// Puts values seed first..first+n-1 (each `bytes` long) under name(seed).
void put_values(Tier& t, int first, int n, std::size_t bytes) {
  std::vector<std::vector<std::byte>> vals;
  std::vector<std::string> names;
  std::vector<const std::byte*> ptrs;
  std::vector<std::size_t> sizes;
  for (int i = first; i < first + n; ++i) {
    vals.push_back(value(i, bytes));
    names.push_back(name(i));
  }
  for (auto& v : vals) {
    ptrs.push_back(v.data());
    sizes.push_back(v.size());
  }
  const auto r = results(t, t.put(names, ptrs, sizes));
  for (int i = 0; i < n; ++i)
    ASSERT_EQ(r[static_cast<std::size_t>(i)], static_cast<std::int64_t>(bytes)) << i;
}

// Gets name(seed) for each seed; returns each result, and whether the bytes equal value(seed).
std::vector<std::int64_t> get_values(Tier& t, const std::vector<int>& seeds, std::size_t bytes,
                                     std::vector<bool>* exact = nullptr) {
  std::vector<std::vector<std::byte>> bufs(seeds.size(), std::vector<std::byte>(bytes + 100));
  std::vector<std::string> names;
  std::vector<std::byte*> dests;
  for (std::size_t i = 0; i < seeds.size(); ++i) {
    names.push_back(name(seeds[i]));
    dests.push_back(bufs[i].data());
  }
  auto r = results(t, t.get(names, dests, bytes + 100));
  if (exact) {
    exact->clear();
    for (std::size_t i = 0; i < seeds.size(); ++i) {
      const auto want = value(seeds[i], bytes);
      exact->push_back(r[i] == static_cast<std::int64_t>(bytes) &&
                       std::memcmp(bufs[i].data(), want.data(), bytes) == 0);
    }
  }
  return r;
}

std::vector<int> range(int first, int n) {
  std::vector<int> v;
  for (int i = first; i < first + n; ++i) v.push_back(i);
  return v;
}

// allocate() for try_resume: blocks first, first + 1, ... one per page of `block_tokens`.
hicache::HostPrefixCache::AllocateFn blocks_from(std::int64_t first, std::int64_t block_tokens) {
  return [=](std::int64_t n) {
    return std::optional<std::vector<std::int64_t>>(hicache_test::ids(first, n / block_tokens));
  };
}

std::vector<fs::path> segment_files(const TempDir& d) {
  std::vector<fs::path> out;
  for (const auto& e : fs::directory_iterator(d.path)) {
    if (e.path().extension() == ".hcd") out.push_back(e.path());
  }
  std::sort(out.begin(), out.end());
  return out;
}

}  // namespace

TEST(DiskTier, ValuesRoundTripAndSurviveARestartByteForByte) {
  TempDir d;
  {
    DiskTier t(options(d));
    put_values(t, 0, 40, 5000);
    std::vector<bool> exact;
    EXPECT_EQ(get_values(t, {3, 39, 1000}, 5000, &exact)[2], Tier::kMissing);
    EXPECT_TRUE(exact[0] && exact[1]);
    EXPECT_EQ(results(t, t.exists(std::vector<std::string>{name(5), name(77)})),
              (std::vector<std::int64_t>{1, 0}));
  }
  DiskTier again(options(d));  // a new process opening the directory, in effect
  std::vector<bool> exact;
  get_values(again, range(0, 40), 5000, &exact);
  EXPECT_EQ(std::count(exact.begin(), exact.end(), true), 40);
  const auto s = again.stats();
  EXPECT_EQ(s.values, 40);
  EXPECT_EQ(s.index_files_used, 1);  // closed cleanly: its segment's index file is read
  EXPECT_EQ(s.segments_scanned, 0);
}

TEST(DiskTier, AProcessKilledWhileWritingLosesAtMostWhatItWasWriting) {
  TempDir d;
  {
    DiskTier t(options(d));
    put_values(t, 0, 10, 3000);
  }
  std::fflush(nullptr);
  const pid_t child = ::fork();
  if (child == 0) {  // writes 10 more, then dies without closing anything
    DiskTier t(options(d));
    put_values(t, 10, 10, 3000);
    ::_exit(0);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  // And a torn entry at the end of the segment it was writing, as a kill mid-write leaves.
  const auto segs = segment_files(d);
  ASSERT_FALSE(segs.empty());
  {
    std::ofstream torn(segs.back(), std::ios::binary | std::ios::app);
    const std::string garbage(6000, 'x');
    torn.write(garbage.data(), static_cast<std::streamsize>(garbage.size()));
  }
  DiskTier t(options(d));
  std::vector<bool> exact;
  get_values(t, range(0, 20), 3000, &exact);
  EXPECT_EQ(std::count(exact.begin(), exact.end(), true), 20);
  EXPECT_GE(t.stats().segments_scanned, 1);  // the one being written had no index file
  EXPECT_EQ(t.stats().damaged_entries, 1);   // the torn end, skipped
  put_values(t, 20, 5, 3000);                // appends go on after the last whole entry
  get_values(t, range(0, 25), 3000, &exact);
  EXPECT_EQ(std::count(exact.begin(), exact.end(), true), 25);
}

TEST(DiskTier, ASecondWriterOfADirectoryIsRefusedWithTheHoldersPid) {
  TempDir d;
  auto first = std::make_unique<DiskTier>(options(d));
  try {
    DiskTier second(options(d));
    FAIL() << "a second DiskTier opened the directory";
  } catch (const hicache::Error& e) {
    EXPECT_NE(std::string(e.what()).find("in use by another DiskTier (process " +
                                         std::to_string(::getpid()) + ")"),
              std::string::npos)
        << e.what();
  }
  first.reset();
  EXPECT_NO_THROW(DiskTier third(options(d)));  // the lock goes with its holder
}

// Values of odd sizes in 4096-aligned memory: put from it and got into it straight (direct I/O
// moves their whole 4 KiB blocks, the tier copies only the tails); into memory that is not
// aligned, through the tier's buffer (the negative control). Exact both ways and after a restart.
TEST(DiskTier, ValuesInAlignedMemoryGoStraightBetweenItAndTheDiskExactly) {
  TempDir d;
  const std::vector<std::size_t> sizes = {3 * 4096 + 100, 8192, 5000, 100, (1 << 20) + 321, 4096};
  const std::int64_t with_head = 5;  // every value but the 100-byte one has whole 4 KiB blocks
  constexpr std::size_t kSlot = (1 << 20) + 8192;
  std::vector<std::byte*> aligned_mem, unaligned_mem;
  std::vector<std::unique_ptr<std::byte, decltype(&std::free)>> owned;
  for (std::size_t i = 0; i < 2 * sizes.size(); ++i) {
    owned.emplace_back(static_cast<std::byte*>(std::aligned_alloc(4096, kSlot + 4096)), &std::free);
  }
  std::vector<std::string> names;
  std::vector<const std::byte*> ptrs;
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    names.push_back(name(static_cast<int>(i)));
    const auto v = value(static_cast<int>(i), sizes[i]);
    std::memcpy(owned[i].get(), v.data(), v.size());
    ptrs.push_back(owned[i].get());
    aligned_mem.push_back(owned[sizes.size() + i].get());
    unaligned_mem.push_back(owned[sizes.size() + i].get() + 256);
  }
  auto check = [&](DiskTier& t, const std::vector<std::byte*>& dests) {
    for (std::byte* p : dests) std::memset(p, 0xEE, kSlot);
    const auto r = results(t, t.get(names, dests, kSlot));
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      ASSERT_EQ(r[i], static_cast<std::int64_t>(sizes[i])) << i;
      const auto want = value(static_cast<int>(i), sizes[i]);
      EXPECT_EQ(std::memcmp(dests[i], want.data(), sizes[i]), 0) << i;
      EXPECT_EQ(dests[i][sizes[i]], std::byte{0xEE}) << i;  // nothing written past the value
    }
  };
  bool direct = false;
  {
    DiskTier t(options(d));
    direct = t.stats().direct_io;
    EXPECT_EQ(t.value_alignment(), direct ? 4096u : 0u);
    const auto r = results(t, t.put(names, ptrs, sizes));
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      EXPECT_EQ(r[i], static_cast<std::int64_t>(sizes[i]));
    }
    EXPECT_EQ(t.stats().values_written_direct, with_head);
    check(t, aligned_mem);
    EXPECT_EQ(t.stats().values_read_direct, with_head);
    check(t, unaligned_mem);
    // Direct I/O cannot read into memory that is not aligned: those went through the buffer.
    EXPECT_EQ(t.stats().values_read_direct, direct ? with_head : 2 * with_head);
  }
  DiskTier t(options(d));
  check(t, aligned_mem);
  EXPECT_EQ(t.stats().values_read_direct, with_head);
  EXPECT_EQ(t.stats().read_failures, 0);
}

TEST(DiskTier, DamagedTruncatedOrDeletedFilesAreMissesNeverWrongValues) {
  TempDir d;
  {
    DiskTier t(options(d, 64 << 20, 1 << 20));
    put_values(t, 0, 30, 60000);  // ~2 segments of 1 MiB
  }
  auto segs = segment_files(d);
  ASSERT_GE(segs.size(), 2u);
  // A flipped byte in the first entry's header: that value fails, the rest are served.
  {
    std::fstream f(segs[0], std::ios::binary | std::ios::in | std::ios::out);
    f.seekp(10);
    f.put('\x5a');
  }
  // The second segment cut short: its last values cannot be read.
  fs::resize_file(segs[1], fs::file_size(segs[1]) / 2);
  DiskTier t(options(d, 64 << 20, 1 << 20));
  std::vector<bool> exact;
  const auto r = get_values(t, range(0, 30), 60000, &exact);
  int served = 0, failed = 0;
  for (std::size_t i = 0; i < r.size(); ++i) {
    if (r[i] >= 0) {
      EXPECT_TRUE(exact[i]) << "value " << i << " served wrong";
      ++served;
    } else {
      ++failed;
    }
  }
  EXPECT_EQ(r[0], Tier::kFailed);    // its header does not check out
  EXPECT_EQ(r[29], Tier::kMissing);  // past the cut: the segment's scan at opening ends there
  EXPECT_GT(served, 10);
  EXPECT_GT(failed, 1);
  EXPECT_EQ(t.stats().read_failures, 1);
  // Failed names leave the index: asked again, they are misses.
  EXPECT_EQ(get_values(t, {0}, 60000)[0], Tier::kMissing);
  // A segment cut short under a running tier: the values past the cut fail when read.
  int last_served = -1;
  for (int i = 0; i < 30; ++i) {
    if (r[static_cast<std::size_t>(i)] >= 0) last_served = i;
  }
  segs = segment_files(d);
  fs::resize_file(segs.back(), 100);
  EXPECT_EQ(get_values(t, {last_served}, 60000)[0], Tier::kFailed);
  EXPECT_EQ(t.stats().read_failures, 2);
  // Segments deleted under a running tier: their open files still serve, exactly.
  for (const auto& p : segment_files(d)) fs::remove(p);
  EXPECT_EQ(get_values(t, {5}, 60000, &exact)[0], 60000);
  EXPECT_TRUE(exact[0]);
}

TEST(DiskTier, CapacityHoldsAndValuesInUseOutliveTheirSegment) {
  TempDir d;
  const std::int64_t cap = 4 << 20, seg = 512 << 10;
  DiskTier t(options(d, cap, seg));
  put_values(t, 0, 8, 60000);  // the first segment
  int next = 8;
  for (int round = 0; round < 12; ++round) {
    // Value 0 is read now and then: each read from the older half moves it up.
    std::vector<bool> exact;
    get_values(t, {0}, 60000, &exact);
    EXPECT_TRUE(exact[0]) << "round " << round;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));  // the rewrite lands
    put_values(t, next, 8, 60000);
    next += 8;
    EXPECT_LE(t.stats().bytes_on_disk, cap);
  }
  const auto s = t.stats();
  EXPECT_GT(s.segments_evicted, 0);
  EXPECT_GT(s.values_rewritten, 0);
  std::vector<bool> exact;
  const auto r = get_values(t, {0, 1, next - 1}, 60000, &exact);
  EXPECT_TRUE(exact[0]);            // in use: kept
  EXPECT_EQ(r[1], Tier::kMissing);  // never read again: evicted with its segment
  EXPECT_TRUE(exact[2]);            // the newest
}

TEST(DiskTier, ADirectoryOfAnotherFormatIsRefused) {
  TempDir d;
  fs::create_directories(d.path);
  std::ofstream(d.path / "FORMAT") << "hicache disk tier, format 0\n";
  EXPECT_THROW(DiskTier t(options(d)), hicache::Error);
  fs::remove(d.path / "FORMAT");
  std::ofstream(d.path / "seg-00000000000000000001.hcd") << "not ours";
  EXPECT_THROW(DiskTier t(options(d)), hicache::Error);
}

TEST(DiskTier, OptionsAreCheckedByName) {
  TempDir d;
  auto o = options(d);
  o.capacity_bytes = 10;
  EXPECT_THROW(DiskTier t(o), std::invalid_argument);
  o = options(d);
  o.direct_io = "maybe";
  EXPECT_THROW(DiskTier t(o), std::invalid_argument);
  o = options(d);
  o.read_threads = 0;
  EXPECT_THROW(DiskTier t(o), std::invalid_argument);
  o = options(d);
  o.path = "";
  EXPECT_THROW(DiskTier t(o), std::invalid_argument);
}

// The engine restarted: a new cache (empty host memory) over the same directory serves the
// prefix the old one stored, byte for byte. Returns the tier's stats after the resume.
hicache::DiskTierStats serve_after_restart(std::int64_t page_bytes) {
  TempDir d;
  constexpr std::int64_t kB = 16;
  const auto kBytes = static_cast<std::size_t>(page_bytes);
  std::vector<std::uint8_t> kv(16 * kBytes);
  for (std::size_t i = 0; i < kv.size(); ++i) kv[i] = static_cast<std::uint8_t>(i * 31 + 7);
  const auto want = kv;
  hicache::CacheConfig c;
  c.block_tokens = kB;
  c.capacity_pages = 16;
  c.admission = hicache::Admission::kAlways;
  c.tier.wait_us = 5'000'000;
  const auto prompt = hicache_test::tokens(6 * kB + 3, 500);
  {
    auto tier = std::make_shared<DiskTier>(options(d));
    hicache::HostPrefixCache cache({{kv.data(), 16, page_bytes, page_bytes}}, {}, c, nullptr, tier);
    EXPECT_EQ(cache.store("a", prompt, hicache_test::ids(0, 7)), 6);
    EXPECT_TRUE(cache.flush_tier());
    EXPECT_EQ(cache.stats().tier_pages_written, 6);
    EXPECT_EQ(tier->stats().values_written, 6);
  }
  std::fill(kv.begin(), kv.end(), 0);
  auto tier = std::make_shared<DiskTier>(options(d));
  hicache::HostPrefixCache cache({{kv.data(), 16, page_bytes, page_bytes}}, {}, c, nullptr, tier);
  EXPECT_EQ(cache.try_resume("b", prompt, blocks_from(8, kB)), 6 * kB);
  EXPECT_EQ(cache.stats().tier_hit_tokens, 6 * kB);
  EXPECT_EQ(std::memcmp(kv.data() + 8 * kBytes, want.data(), 6 * kBytes), 0);
  return tier->stats();
}

TEST(DiskTier, AHostCacheOverItServesAfterARestartExactly) {
  const hicache::DiskTierStats s = serve_after_restart(4096);
  EXPECT_EQ(s.values_read, 6);
}

TEST(DiskTier, ACacheOfLargePagesAlignsItsSlotsSoPagesGoStraightToAndFromTheDisk) {
  // 256 KiB pages: the slots (page and record) are aligned to 4096 (at a cost of 1/70 of a
  // slot), so direct I/O reads each page straight into its host slot. (4 KiB pages would pay
  // nearly a whole page for it: those go through the tier's buffer, the case above.)
  const hicache::DiskTierStats s = serve_after_restart(256 << 10);
  EXPECT_EQ(s.values_read, 6);
  EXPECT_EQ(s.values_read_direct, 6);
}

TEST(DiskTier, AFetchOfManyRoundsInFlightEndsExactlyBeforeADamagedPage) {
  // Rounds of two pages, three in flight behind the one being checked: a 12-page prefix whose
  // page 7 was damaged on disk is served through page 6, exactly, and nothing stays held.
  TempDir d;
  constexpr std::int64_t kB = 16, kBytes = 4096;
  std::vector<std::uint8_t> kv(16 * kBytes);
  std::mt19937 rng(9);
  for (auto& b : kv) b = static_cast<std::uint8_t>(rng());
  const auto want = kv;
  hicache::CacheConfig c;
  c.block_tokens = kB;
  c.capacity_pages = 16;
  c.admission = hicache::Admission::kAlways;
  c.tier.wait_us = 5'000'000;
  c.tier.buffer_bytes = 4 * kBytes;  // two pages a round
  const auto prompt = hicache_test::tokens(12 * kB + 3, 700);
  {
    auto tier = std::make_shared<DiskTier>(options(d));
    hicache::HostPrefixCache cache({{kv.data(), 16, kBytes, kBytes}}, {}, c, nullptr, tier);
    EXPECT_EQ(cache.store("a", prompt, hicache_test::ids(0, 13)), 12);
    EXPECT_TRUE(cache.flush_tier());
  }
  const auto segs = segment_files(d);
  ASSERT_EQ(segs.size(), 1u);
  const std::size_t extent = fs::file_size(segs[0]) / 12;  // the 12 pages' entries, equal in size
  {
    // Page 7's bytes: an entry's page lies last in it, after the lead block (header, record).
    const auto at = static_cast<std::streamoff>(7 * extent + (extent - kBytes) + 100);
    std::fstream f(segs[0], std::ios::binary | std::ios::in | std::ios::out);
    f.seekg(at);
    const char was = static_cast<char>(f.get());
    f.seekp(at);
    f.put(static_cast<char>(was ^ 0x5A));
  }
  std::fill(kv.begin(), kv.end(), 0);
  auto tier = std::make_shared<DiskTier>(options(d));
  hicache::HostPrefixCache cache({{kv.data(), 16, kBytes, kBytes}}, {}, c, nullptr, tier);
  const std::int64_t got = cache.try_resume("b", prompt, blocks_from(0, kB));
  EXPECT_EQ(got, 7 * kB);
  EXPECT_EQ(std::memcmp(kv.data(), want.data(), 7 * kBytes), 0);
  cache.poll();
  const auto s = cache.stats();
  EXPECT_EQ(s.tier_pages_rejected, 1);
  EXPECT_EQ(s.pages_busy, 0);  // every round, in flight or landed, was given back
  // Asked again: the same prefix, exactly (the damaged page is fetched and refused again).
  std::fill(kv.begin(), kv.end(), 0);
  EXPECT_EQ(cache.try_resume("c", prompt, blocks_from(0, kB)), 7 * kB);
  EXPECT_EQ(std::memcmp(kv.data(), want.data(), 7 * kBytes), 0);
}
