// HostPrefixCache on CPU segments: round trips, the resume policy, eviction, failure isolation,
// bounds checks and threads.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <random>
#include <thread>

#include "chain_hasher.hpp"
#include "fake_engine.hpp"
#include "hicache/hicache.hpp"
#include "test_support.hpp"

namespace {

using hicache_test::ids;
using hicache_test::numbered;
using hicache_test::tokens;

using hicache::CacheConfig;
using hicache::HostPrefixCache;
using hicache_test::FakeEngine;
using hicache_test::give;
using hicache_test::small_config;

void round_trip(FakeEngine& eng) {
  HostPrefixCache cache(eng.segments(), {}, small_config(8));
  for (std::int64_t b = 0; b < 4; ++b) eng.fill(b, static_cast<std::uint32_t>(100 + b));
  std::vector<std::vector<std::uint8_t>> before;
  for (std::int64_t b = 0; b < 4; ++b) before.push_back(eng.page(b));
  const auto prompt = tokens(4 * 16 + 3);
  EXPECT_EQ(cache.store("r1", prompt, ids(0, 5)), 4);
  cache.poll();
  for (std::int64_t b = 4; b < 8; ++b) eng.clear(b);
  EXPECT_EQ(cache.try_resume("r2", prompt, give(ids(4, 4))), 64);
  for (std::int64_t b = 0; b < 4; ++b)
    EXPECT_EQ(eng.page(4 + b), before[static_cast<std::size_t>(b)]);
  EXPECT_TRUE(eng.canaries_intact());
}

}  // namespace

TEST(HostPrefixCache, PageMajorBytesRoundTripExactly) {
  FakeEngine eng(8, {4096});
  round_trip(eng);
}

TEST(HostPrefixCache, LayerMajorFourSegmentsWithPaddedStridesRoundTripExactly) {
  FakeEngine eng(8, {512, 512, 96, 1040}, /*pad=*/48);
  round_trip(eng);
}

TEST(HostPrefixCache, LongHitsAndLateMissesAcrossTheHashingInstallments) {
  // A store hashes, admits and copies 16 pages, then 16, 32...; a lookup finds cached pages by
  // content and hashes 16 pages past them: hits and misses on both sides of 16, 32 and 64 pages
  // must be exactly what is cached.
  FakeEngine eng(256, {8});
  HostPrefixCache cache(eng.segments(), {}, small_config(200));
  const auto base = tokens(100 * 16 + 1);
  for (std::int64_t b = 0; b < 100; ++b) eng.fill(b, static_cast<std::uint32_t>(7000 + b));
  ASSERT_EQ(cache.store("s", base, ids(0, 101)), 100);
  cache.poll();
  cache.forget("s");
  for (std::int64_t pages : {1, 15, 16, 17, 31, 32, 33, 63, 64, 65, 99, 100}) {
    SCOPED_TRACE(pages);
    // The cached prefix of `pages` pages, then tokens no page holds.
    auto prompt = tokens(static_cast<std::size_t>(pages * 16));
    for (int i = 0; i < 40; ++i) prompt.push_back(900000 + i);
    const std::int64_t expect = pages * 16;
    EXPECT_EQ(cache.try_resume("r", prompt, give(ids(120, 102))), expect);
    for (std::int64_t b = 0; b < pages; ++b) ASSERT_EQ(eng.page(120 + b), eng.page(b)) << b;
    cache.poll();
    cache.forget("r");
  }
  EXPECT_EQ(cache.try_resume("w", base, give(ids(120, 102))), 100 * 16);
  cache.forget("w");
  auto shorter = tokens(64 * 16);  // exactly 64 pages: the cap keeps the last page's last token
  EXPECT_EQ(cache.try_resume("x", shorter, give(ids(120, 102))), 63 * 16);
  cache.forget("x");
}

// A long store hashes its later installments' token blocks ahead on the page threads (thousands
// of pages here); lookups then find the pages by content: hits end exactly where the cache does.
TEST(HostPrefixCache, LongPromptsHashedAheadHitExactlyWhatIsCached) {
  constexpr std::int64_t kPages = 9000;
  FakeEngine eng(2 * kPages + 2, {8});
  HostPrefixCache cache(eng.segments(), {}, small_config(kPages + 10));
  const auto base = tokens(static_cast<std::size_t>(kPages * 16 + 1));
  for (std::int64_t b = 0; b < kPages; ++b) eng.fill(b, static_cast<std::uint32_t>(b * 7 + 1));
  ASSERT_EQ(cache.store("s", base, ids(0, kPages + 1)), kPages);
  cache.poll();
  cache.forget("s");
  for (std::int64_t pages : {17, 2100, 8192, 8193, 8999}) {
    SCOPED_TRACE(pages);
    auto prompt = tokens(static_cast<std::size_t>(pages * 16));
    for (int i = 0; i < 40; ++i) prompt.push_back(900000 + i);  // then tokens no page holds
    EXPECT_EQ(cache.try_resume("r", prompt, give(ids(kPages + 1, kPages + 1))), pages * 16);
    for (std::int64_t b : {std::int64_t{0}, pages / 2, pages - 1}) {
      ASSERT_EQ(eng.page(kPages + 1 + b), eng.page(b)) << b;
    }
    cache.poll();
    cache.forget("r");
  }
  EXPECT_EQ(cache.try_resume("w", base, give(ids(kPages + 1, kPages + 1))), kPages * 16);
  cache.forget("w");
}

// Cached pages are found by their content (parent and tokens), not by hashing their chain keys:
// a lookup of a cached prefix hashes only past it, and a store of a longer prompt (the next turn)
// hashes only its new pages.
TEST(HostPrefixCache, ACachedPrefixIsFoundByContentWithoutHashingIt) {
  using hicache::detail::ChainHasher;
  FakeEngine eng(256, {8});
  HostPrefixCache cache(eng.segments(), {}, small_config(200));
  for (std::int64_t b = 0; b < 100; ++b) eng.fill(b, static_cast<std::uint32_t>(300 + b));
  const auto turn1 = tokens(60 * 16 + 1);
  std::uint64_t before = ChainHasher::keys_hashed();
  ASSERT_EQ(cache.store("s", turn1, ids(0, 61)), 60);
  EXPECT_EQ(ChainHasher::keys_hashed() - before, 60u);  // a new prompt: every page hashed
  cache.poll();
  cache.forget("s");

  before = ChainHasher::keys_hashed();
  EXPECT_EQ(cache.try_resume("r", turn1, give(ids(100, 61))), 60 * 16);
  EXPECT_EQ(ChainHasher::keys_hashed() - before, 0u);
  for (std::int64_t b = 0; b < 60; ++b) ASSERT_EQ(eng.page(100 + b), eng.page(b)) << b;
  cache.poll();
  cache.forget("r");

  auto turn2 = tokens(70 * 16 + 1);  // the next turn: the same 60 pages, then 10 new ones
  before = ChainHasher::keys_hashed();
  EXPECT_EQ(cache.try_resume("t", turn2, give(ids(100, 71))), 60 * 16);
  EXPECT_EQ(ChainHasher::keys_hashed() - before, 10u);  // only past the cached pages
  cache.poll();
  cache.forget("t");
  before = ChainHasher::keys_hashed();
  EXPECT_EQ(cache.store("t2", turn2, ids(0, 71)), 10);
  EXPECT_EQ(ChainHasher::keys_hashed() - before, 10u);
  cache.poll();
  cache.forget("t2");
  EXPECT_EQ(cache.try_resume("u", turn2, give(ids(100, 71))), 70 * 16);
  cache.forget("u");

  // Negative control: the same prompt under another salt has no cached page; its lookup hashes
  // its first installment and misses.
  before = ChainHasher::keys_hashed();
  EXPECT_EQ(cache.try_resume("v", turn2, give(ids(100, 71)), nullptr, std::nullopt, "other"), 0);
  EXPECT_EQ(ChainHasher::keys_hashed() - before, 16u);
  cache.forget("v");
}

TEST(HostPrefixCache, KeepTokensCapLeavesTheTailToCompute) {
  FakeEngine eng(8, {64});
  CacheConfig c = small_config(8);
  c.keep_tokens = 1;
  HostPrefixCache cache(eng.segments(), {}, c);
  cache.store("a", tokens(48), ids(0, 3));
  // Exactly three full blocks: the last token must be computed, so only two pages may be used.
  EXPECT_EQ(cache.try_resume("b", tokens(48), give(ids(3, 3))), 32);
  EXPECT_EQ(cache.try_resume("c", tokens(49), give(ids(3, 3))), 48);

  c.keep_tokens = 20;
  HostPrefixCache cache2(eng.segments(), {}, c);
  cache2.store("a", tokens(48), ids(0, 3));
  EXPECT_EQ(cache2.try_resume("b", tokens(49), give(ids(3, 3))), 16);  // 49 - 20 = 29 -> 1 page
  EXPECT_EQ(cache2.try_resume("c", tokens(20), give(ids(3, 3))), 0);
}

TEST(HostPrefixCache, StatesAreStoredAtTheLastBoundariesAndResumeSnapsToOne) {
  FakeEngine eng(16, {64});
  CacheConfig c = small_config(16);
  c.state_bytes = 24;
  c.capacity_states = 8;
  c.state_lookback = 2;
  HostPrefixCache cache(eng.segments(), {}, c);
  std::vector<std::uint8_t> staging(24);
  std::vector<std::int64_t> asked;
  auto exporter = [&](std::int64_t pos) -> std::optional<hicache::DeviceBuffer> {
    asked.push_back(pos);
    std::fill(staging.begin(), staging.end(), static_cast<std::uint8_t>(pos));
    return hicache::DeviceBuffer{staging.data(), staging.size(), {}};
  };
  const auto prompt = tokens(5 * 16 + 7);
  cache.store("a", prompt, ids(0, 6), nullptr, exporter);
  EXPECT_EQ(asked, (std::vector<std::int64_t>{80, 64}));  // last two boundaries, latest first
  cache.poll();                                           // counted once published
  EXPECT_EQ(cache.stats().states_stored, 2);

  std::vector<std::uint8_t> out(24, 0);
  hicache::DeviceBuffer out_buf{out.data(), out.size(), {}};
  // Full prompt: 5 pages match, a state exists at 80.
  EXPECT_EQ(cache.try_resume("b", prompt, give(ids(8, 5)), nullptr, out_buf), 80);
  EXPECT_EQ(out[0], 80);
  // A prompt diverging in page 4 matches 4 pages (64 tokens): state at 64 exists.
  auto other = prompt;
  other[4 * 16 + 2] = -1;
  EXPECT_EQ(cache.try_resume("c", other, give(ids(8, 5)), nullptr, out_buf), 64);
  EXPECT_EQ(out[0], 64);
  // Diverging in page 3: 3 pages match but no state at 48, 32 or 16: a miss.
  other[3 * 16] = -1;
  EXPECT_EQ(cache.try_resume("d", other, give(ids(8, 5)), nullptr, out_buf), 0);
  // Without state_out the call is malformed.
  EXPECT_THROW(cache.try_resume("e", prompt, give(ids(8, 5))), std::invalid_argument);
  // A second store asks only for what is missing.
  asked.clear();
  cache.store("f", prompt, ids(0, 6), nullptr, exporter);
  EXPECT_TRUE(asked.empty());
}

TEST(HostPrefixCache, StatesAreStoredAtGeometricallySpacedBoundaries) {
  // A branch that leaves an earlier prompt a few blocks before its end still finds a state.
  FakeEngine eng(16, {64});
  CacheConfig c = small_config(16);
  c.state_bytes = 8;
  c.capacity_states = 8;
  EXPECT_EQ(c.state_lookback, 4);  // the default: the last boundary, 1, 2 and 4 blocks before
  HostPrefixCache cache(eng.segments(), {}, c);
  std::vector<std::uint8_t> staging(8);
  std::vector<std::int64_t> asked;
  auto exporter = [&](std::int64_t pos) -> std::optional<hicache::DeviceBuffer> {
    asked.push_back(pos);
    std::fill(staging.begin(), staging.end(), static_cast<std::uint8_t>(pos));
    return hicache::DeviceBuffer{staging.data(), staging.size(), {}};
  };
  const auto prompt = tokens(7 * 16 + 3);
  cache.store("a", prompt, ids(0, 8), nullptr, exporter);
  EXPECT_EQ(asked, (std::vector<std::int64_t>{112, 96, 80, 48}));
  cache.poll();
  std::vector<std::uint8_t> out(8, 0);
  hicache::DeviceBuffer out_buf{out.data(), out.size(), {}};
  auto branch = prompt;
  branch[70] = -1;  // leaves the prompt in block 4: 4 pages shared, the state at 48 below them
  EXPECT_EQ(cache.try_resume("b", branch, give(ids(8, 5)), nullptr, out_buf), 48);
  EXPECT_EQ(out[0], 48);

  CacheConfig bad = small_config(16);
  bad.state_bytes = 8;
  bad.capacity_states = 1;
  bad.state_lookback = 49;  // 2**47 blocks back: no prompt is that long
  EXPECT_THROW(HostPrefixCache(eng.segments(), {}, bad), std::invalid_argument);
}

TEST(HostPrefixCache, StateExportReturningNothingSkipsThatBoundary) {
  FakeEngine eng(8, {64});
  CacheConfig c = small_config(8);
  c.state_bytes = 8;
  c.capacity_states = 4;
  c.state_lookback = 3;
  HostPrefixCache cache(eng.segments(), {}, c);
  std::vector<std::uint8_t> staging(8, 7);
  auto exporter = [&](std::int64_t pos) -> std::optional<hicache::DeviceBuffer> {
    if (pos < 48) return std::nullopt;  // the engine's ring reaches back only so far
    return hicache::DeviceBuffer{staging.data(), staging.size(), {}};
  };
  cache.store("a", tokens(3 * 16 + 1), ids(0, 4), nullptr, exporter);
  cache.poll();
  EXPECT_EQ(cache.stats().states_stored, 1);
}

TEST(HostPrefixCache, AStateOfSeveralPartsComesBackPartByPart) {
  // A hybrid model's state in three buffers of different sizes (a conv state, an SSM state in
  // another dtype, a window): stored back to back, loaded each into its own buffer.
  FakeEngine eng(8, {64});
  CacheConfig c = small_config(8);
  c.state_parts = {3, 16, 5};
  c.capacity_states = 4;
  c.state_lookback = 1;
  HostPrefixCache cache(eng.segments(), {}, c);
  EXPECT_EQ(cache.config().state_bytes, 24);
  std::vector<std::vector<std::uint8_t>> staging = {std::vector<std::uint8_t>(3, 0xC0),
                                                    std::vector<std::uint8_t>(16, 0x55),
                                                    std::vector<std::uint8_t>(5, 0x0E)};
  auto as_state = [](std::vector<std::vector<std::uint8_t>>& bufs) {
    hicache::StateBuffers s;
    for (auto& b : bufs) s.parts.push_back({b.data(), b.size(), {}});
    return s;
  };
  auto exporter = [&](std::int64_t) -> std::optional<hicache::StateBuffers> {
    return as_state(staging);
  };
  cache.store("a", tokens(33), ids(0, 3), nullptr, exporter);
  cache.poll();
  EXPECT_EQ(cache.stats().states_stored, 1);
  std::vector<std::vector<std::uint8_t>> out = {
      std::vector<std::uint8_t>(3), std::vector<std::uint8_t>(16), std::vector<std::uint8_t>(5)};
  EXPECT_EQ(cache.try_resume("b", tokens(33), give(ids(4, 2)), nullptr, as_state(out)), 32);
  EXPECT_EQ(out, staging);

  // Parts of the wrong count or size are refused by name, before anything is copied.
  auto two = out;
  two.pop_back();
  try {
    cache.try_resume("c", tokens(33), give(ids(4, 2)), nullptr, as_state(two));
    FAIL() << "two parts accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("3 parts of [3, 16, 5] bytes"), std::string::npos)
        << e.what();
  }
  auto wrong = out;
  wrong[1].resize(15);
  try {
    cache.try_resume("d", tokens(33), give(ids(4, 2)), nullptr, as_state(wrong));
    FAIL() << "a 15-byte part 1 accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("part 1 must be 16 bytes"), std::string::npos) << e.what();
  }
  staging[2].resize(4);
  EXPECT_THROW(cache.store("e", tokens(49), ids(0, 4), nullptr, exporter), std::invalid_argument);
  cache.poll();
  EXPECT_EQ(cache.stats().states_stored, 1);  // the store that raised published nothing
  EXPECT_EQ(cache.stats().pages_stored, 2);   // nor counted its page as stored
  EXPECT_EQ(cache.stats().pages_discarded, 1);

  CacheConfig bad = small_config(8);
  bad.state_parts = {4, 0};
  bad.capacity_states = 1;
  EXPECT_THROW(HostPrefixCache(eng.segments(), {}, bad), std::invalid_argument);
  bad.state_parts = {4, 4};
  bad.state_bytes = 9;  // neither 0 nor the parts' sum
  EXPECT_THROW(HostPrefixCache(eng.segments(), {}, bad), std::invalid_argument);
}

TEST(HostPrefixCache, AStateOnlyCacheIndexesPagesOfNoBytes) {
  // A model without full-attention layers (Mamba, every layer a sliding window): no segments.
  CacheConfig c = small_config(64);
  c.state_bytes = 16;
  c.capacity_states = 2;
  c.state_lookback = 1;
  HostPrefixCache cache({}, {}, c);
  std::vector<std::uint8_t> staging(16, 0x3C);
  auto exporter = [&](std::int64_t) -> std::optional<hicache::DeviceBuffer> {
    return hicache::DeviceBuffer{staging.data(), staging.size(), {}};
  };
  // Block ids are placeholders (one a page, any value): no block holds anything.
  const std::vector<std::int64_t> placeholders = {0, 0};
  EXPECT_EQ(cache.store("a", tokens(40), placeholders, nullptr, exporter), 2);
  cache.poll();
  std::vector<std::uint8_t> out(16, 0);
  hicache::DeviceBuffer out_buf{out.data(), out.size(), {}};
  EXPECT_EQ(cache.try_resume("b", tokens(40), give({0, 0}), nullptr, out_buf), 32);
  EXPECT_EQ(out, staging);
  auto other = tokens(40);
  other[20] = -1;  // page 1 differs: its state is not served for page 0's boundary (none there)
  EXPECT_EQ(cache.try_resume("c", other, give(ids(0, 1)), nullptr, out_buf), 0);
  EXPECT_LT(cache.stats().host_bytes, 32 << 10);  // 64 pages of one 64-byte slot, the states

  CacheConfig none = small_config(4);  // neither segments nor state: nothing to keep
  EXPECT_THROW(HostPrefixCache({}, {}, none), std::invalid_argument);
}

TEST(HostPrefixCache, DeferredAllocationReturnsMinusOneAndReleasesThePages) {
  FakeEngine eng(4, {64});
  HostPrefixCache cache(eng.segments(), {}, small_config(2));
  cache.store("a", tokens(33), ids(0, 3));
  auto refuse = [](std::int64_t) -> std::optional<std::vector<std::int64_t>> {
    return std::nullopt;
  };
  EXPECT_EQ(cache.try_resume("b", tokens(33), refuse), -1);
  auto s = cache.stats();
  EXPECT_EQ(s.deferred, 1);
  EXPECT_EQ(s.hits, 0);
  EXPECT_EQ(s.pages_busy, 0);  // nothing stays held after a deferral
  EXPECT_EQ(cache.try_resume("b", tokens(33), give(ids(2, 2))), 32);
}

TEST(HostPrefixCache, InFlightEntriesAreNeitherHitNorEvictedUntilTheirCopyCompletes) {
  FakeEngine eng(8, {64});
  auto copier = std::make_shared<hicache::DeferredCopier>();
  HostPrefixCache cache(eng.segments(), {}, small_config(2), copier);
  for (std::int64_t b = 0; b < 8; ++b) eng.fill(b, static_cast<std::uint32_t>(b));
  const auto a = tokens(33), b = tokens(33, 1000);
  EXPECT_EQ(cache.store("a", a, ids(0, 2)), 2);
  // Invariant 1: not hit-able before the device-to-host copy completed.
  EXPECT_EQ(cache.try_resume("x", a, give(ids(4, 2))), 0);
  // Invariant 2: both slots are held, so a second store cannot evict them.
  EXPECT_EQ(cache.store("b", b, ids(2, 2)), 0);
  EXPECT_EQ(cache.stats().store_skips, 1);
  copier->complete();
  EXPECT_EQ(cache.poll(), 1);
  // A load in flight holds its pages too.
  EXPECT_EQ(cache.try_resume("y", a, give(ids(4, 2))), 32);
  EXPECT_EQ(cache.store("b", b, ids(2, 2)), 0);
  copier->complete();
  cache.poll();
  EXPECT_EQ(eng.page(4), eng.page(0));
  EXPECT_EQ(eng.page(5), eng.page(1));
  // Now idle: LRU eviction makes room.
  EXPECT_EQ(cache.store("b", b, ids(2, 2)), 2);
  EXPECT_EQ(cache.stats().pages_evicted, 2);
}

TEST(HostPrefixCache, LruEvictsTheLeastRecentlyUsedChain) {
  FakeEngine eng(8, {64});
  HostPrefixCache cache(eng.segments(), {}, small_config(4));
  const auto a = tokens(33), b = tokens(33, 500), c = tokens(33, 900);
  cache.store("a", a, ids(0, 2));
  cache.store("b", b, ids(2, 2));
  EXPECT_EQ(cache.try_resume("a2", a, give(ids(4, 2))), 32);  // a is now most recent
  cache.store("c", c, ids(4, 2));                             // evicts b
  EXPECT_EQ(cache.try_resume("b2", b, give(ids(6, 2))), 0);
  EXPECT_EQ(cache.try_resume("a3", a, give(ids(6, 2))), 32);
  EXPECT_EQ(cache.try_resume("c2", c, give(ids(6, 2))), 32);
}

TEST(HostPrefixCache, StaleChildOfAReplacedParentIsNotServedThenReplaced) {
  FakeEngine eng(16, {64});
  auto copier = std::make_shared<hicache::DeferredCopier>();
  CacheConfig c = small_config(4);
  c.eviction = hicache::EvictionPolicy::kLru;  // evicts a parent before its child
  HostPrefixCache cache(eng.segments(), {}, c, copier);
  auto* s1 = reinterpret_cast<hicache::StreamHandle>(1);
  auto* s2 = reinterpret_cast<hicache::StreamHandle>(2);
  const auto ab = tokens(33);  // pages a, b
  const auto a = std::vector<std::int32_t>(ab.begin(), ab.begin() + 17);
  auto store_now = [&](const char* id, const std::vector<std::int32_t>& t, std::int64_t block) {
    cache.store(id, t, ids(block, 2), s2);
    copier->complete(s2);
  };
  cache.store("1", a, ids(0, 2), s1);
  copier->complete(s1);
  cache.store("2", ab, ids(0, 2), s1);  // b's copy stays in flight on s1
  store_now("3", tokens(17, 500), 2);   // x
  store_now("4", tokens(17, 600), 3);   // y: the pool is full
  store_now("5", tokens(17, 700), 4);   // evicts a (b is held)
  store_now("6", a, 5);                 // a again, with a new serial; evicts x
  copier->complete(s1);                 // b lands, linked to the old a
  // b is present with the right tokens, but its parent is the old a: only a is served.
  EXPECT_EQ(cache.try_resume("7", ab, give(ids(8, 2))), 16);
  cache.store("8", ab, ids(0, 2));  // replaces the stale b
  copier->complete();
  EXPECT_EQ(cache.try_resume("9", ab, give(ids(8, 2))), 32);
}

TEST(HostPrefixCache, LruStrandsAChildWhileLeafFirstEvictsLeavesFirst) {
  FakeEngine eng(8, {64});
  const auto ab = tokens(33), c = tokens(17, 500), d = tokens(17, 900);
  auto run = [&](hicache::EvictionPolicy policy) {
    CacheConfig cfg = small_config(3);
    cfg.eviction = policy;
    HostPrefixCache cache(eng.segments(), {}, cfg);
    cache.store("1", ab, ids(0, 3));  // pages a, b
    cache.store("2", c, ids(3, 2));
    cache.store("3", d, ids(5, 2));  // the pool is full: one page of chain a-b goes
    return cache.try_resume("4", ab, give(ids(0, 2)));
  };
  EXPECT_EQ(run(hicache::EvictionPolicy::kLru), 0);         // a went; b is stranded
  EXPECT_EQ(run(hicache::EvictionPolicy::kLeafFirst), 16);  // b went; a still serves
}

TEST(HostPrefixCache, CollidingKeysNeverServeAnotherPrefix) {
  FakeEngine eng(64, {64});
  CacheConfig c = small_config(32);
  c.key_bits = 2;  // four possible keys: collisions everywhere
  HostPrefixCache cache(eng.segments(), {}, c);
  std::mt19937 rng(7);
  // Every block holds bytes derived from its whole prefix; a wrong page would show.
  auto prefix_seed = [](const std::vector<std::int32_t>& t, std::size_t end) {
    std::uint32_t h = 2166136261u;
    for (std::size_t i = 0; i < end; ++i) h = (h ^ static_cast<std::uint32_t>(t[i])) * 16777619u;
    return h;
  };
  int hits = 0;
  for (int round = 0; round < 400; ++round) {
    // Three candidate pages at each position: prefixes repeat (real hits) and, with two-bit
    // keys, different pages share keys all the time.
    std::vector<std::int32_t> t(16 * 3 + 1, 0);
    for (std::size_t p = 0; p < 3; ++p) {
      const auto choice = static_cast<std::int32_t>(rng() % 3);
      for (std::size_t i = 0; i < 16; ++i)
        t[p * 16 + i] = choice * 7 + static_cast<std::int32_t>(i % 2);
    }
    for (std::int64_t p = 0; p < 3; ++p)
      eng.fill(p, prefix_seed(t, static_cast<std::size_t>(16 * (p + 1))));
    const std::int64_t got = cache.try_resume("r", t, give(ids(10, 3)));
    for (std::int64_t p = 0; p < got / 16; ++p) {
      ASSERT_EQ(eng.page(10 + p), eng.page(p)) << "round " << round << " page " << p;
    }
    hits += got > 0;
    cache.store("r", t, ids(0, 4));
  }
  EXPECT_GT(hits, 0);
  EXPECT_GT(cache.stats().collisions, 0);
}

TEST(HostPrefixCache, SaltsSeparateTenants) {
  FakeEngine eng(8, {64});
  HostPrefixCache cache(eng.segments(), {}, small_config(8));
  const auto t = tokens(33);
  cache.store("a", t, ids(0, 2), nullptr, {}, "tenant-a");
  EXPECT_EQ(cache.try_resume("b", t, give(ids(4, 2)), nullptr, std::nullopt, "tenant-b"), 0);
  EXPECT_EQ(cache.try_resume("c", t, give(ids(4, 2))), 0);  // default salt "" differs too
  EXPECT_EQ(cache.try_resume("d", t, give(ids(4, 2)), nullptr, std::nullopt, "tenant-a"), 32);
}

TEST(HostPrefixCache, BadBlockIdsThrowAndWriteNothing) {
  FakeEngine eng(4, {64}, 16);
  HostPrefixCache cache(eng.segments(), {}, small_config(4));
  const auto t = tokens(33);
  EXPECT_THROW(cache.store("a", t, std::vector<std::int64_t>{0, 4}), std::out_of_range);
  EXPECT_THROW(cache.store("a", t, std::vector<std::int64_t>{-1, 0}), std::out_of_range);
  EXPECT_THROW(cache.store("a", t, std::vector<std::int64_t>{0}), std::invalid_argument);
  EXPECT_EQ(cache.stats().pages_used, 0);
  cache.store("a", t, ids(0, 2));
  auto bad = [](std::vector<std::int64_t> v) {
    return [v](std::int64_t) -> std::optional<std::vector<std::int64_t>> { return v; };
  };
  eng.fill(2, 1);
  eng.fill(3, 2);
  const auto p2 = eng.page(2), p3 = eng.page(3);
  EXPECT_THROW(cache.try_resume("b", t, bad({2, 4})), std::out_of_range);
  EXPECT_THROW(cache.try_resume("b", t, bad({2, 2})), std::invalid_argument);
  EXPECT_THROW(cache.try_resume("b", t, bad({2})), std::invalid_argument);
  EXPECT_EQ(eng.page(2), p2);
  EXPECT_EQ(eng.page(3), p3);
  EXPECT_TRUE(eng.canaries_intact());
  EXPECT_EQ(cache.stats().pages_busy, 0);
  EXPECT_THROW(cache.try_resume("b", std::vector<std::int32_t>{}, bad({})), std::invalid_argument);
}

TEST(HostPrefixCache, BadLayoutsAndConfigsAreRejected) {
  FakeEngine eng(4, {64});
  CacheConfig c = small_config(4);
  auto segs = eng.segments();
  segs[0].block_stride = 32;
  EXPECT_THROW(HostPrefixCache(segs, {}, c), std::invalid_argument);
  EXPECT_THROW(HostPrefixCache({}, {}, c), std::invalid_argument);
  c.keep_tokens = 0;
  EXPECT_THROW(HostPrefixCache(eng.segments(), {}, c), std::invalid_argument);
  c = small_config(0);
  EXPECT_THROW(HostPrefixCache(eng.segments(), {}, c), std::invalid_argument);
  c = small_config(4);
  c.state_bytes = 8;  // and no state slots
  EXPECT_THROW(HostPrefixCache(eng.segments(), {}, c), std::invalid_argument);
  hicache::Device cuda{hicache::DeviceKind::kCuda, 0};
  if (!hicache::cuda_available()) {
    EXPECT_THROW(HostPrefixCache(eng.segments(), cuda, small_config(4)), std::invalid_argument);
  }
}

TEST(HostPrefixCache, ForgetDiscardsUnfinishedStoresAndRejectsUnknownIds) {
  FakeEngine eng(8, {64});
  auto copier = std::make_shared<hicache::DeferredCopier>();
  HostPrefixCache cache(eng.segments(), {}, small_config(4), copier);
  const auto t = tokens(33);
  cache.store("a", t, ids(0, 2));
  cache.forget("a");                       // aborted before the copy ran: its blocks may be reused
  EXPECT_EQ(cache.stats().pages_busy, 2);  // slots still held by the copy in flight
  copier->complete();
  cache.poll();
  auto s = cache.stats();
  EXPECT_EQ(s.pages_used, 0);
  EXPECT_EQ(s.pages_busy, 0);
  EXPECT_EQ(cache.try_resume("b", t, give(ids(4, 2))), 0);
  EXPECT_THROW(cache.forget("a"), hicache::UnknownRequest);
  EXPECT_THROW(cache.forget("never"), hicache::UnknownRequest);
  // Once completed, a forgotten request's stores stay.
  cache.store("c", t, ids(0, 2));
  copier->complete();
  cache.forget("c");
  EXPECT_EQ(cache.try_resume("d", t, give(ids(4, 2))), 32);
}

namespace {

// Fails every copy while `fail` is set.
class FlakyCopier : public hicache::CpuCopier {
 public:
  void copy_pages(hicache::Direction d, const hicache::PageLayout& l,
                  std::span<const hicache::PageMove> m, hicache::StreamHandle s) override {
    if (fail) throw hicache::Error("planned copy failure");
    CpuCopier::copy_pages(d, l, m, s);
  }
  std::atomic<bool> fail{false};
};

}  // namespace

TEST(HostPrefixCache, CopyFailuresDegradeToMissesThenDisableTheCache) {
  FakeEngine eng(8, {64});
  auto copier = std::make_shared<FlakyCopier>();
  CacheConfig c = small_config(8);
  c.error_limit = 3;
  HostPrefixCache cache(eng.segments(), {}, c, copier);
  const auto t = tokens(33);
  cache.store("a", t, ids(0, 2));
  copier->fail = true;
  EXPECT_EQ(cache.try_resume("b", t, give(ids(4, 2))), 0);  // no exception: a miss
  EXPECT_EQ(cache.store("c", tokens(33, 100), ids(2, 2)), 0);
  auto s = cache.stats();
  EXPECT_EQ(s.errors, 2);
  EXPECT_FALSE(s.disabled);
  cache.poll();  // a failed copy holds its slots until its fence says the stream passed it
  s = cache.stats();
  EXPECT_EQ(s.pages_busy, 0);
  EXPECT_EQ(s.pages_used, 2);  // the failed store left nothing behind
  copier->fail = false;
  EXPECT_EQ(cache.try_resume("d", t, give(ids(4, 2))), 32);  // recovered
  copier->fail = true;
  for (int i = 0; i < 3; ++i) cache.try_resume("e", t, give(ids(4, 2)));
  s = cache.stats();
  EXPECT_TRUE(s.disabled);
  EXPECT_NE(s.disabled_reason.find("planned copy failure"), std::string::npos);
  copier->fail = false;
  EXPECT_EQ(cache.try_resume("f", t, give(ids(4, 2))), 0);  // stays off
}

namespace {

// A CPU copier that says it joins runs (as the CUDA copier's DMA path does) or not, and keeps
// the host addresses of each store's pages, in the order of the call's moves.
class RunJoiningCopier : public hicache::CpuCopier {
 public:
  explicit RunJoiningCopier(bool joins) : joins_(joins) {}
  void copy_pages(hicache::Direction d, const hicache::PageLayout& l,
                  std::span<const hicache::PageMove> m, hicache::StreamHandle s) override {
    if (d == hicache::Direction::kToHost) {
      for (const auto& mv : m) stored.push_back(mv.host);
    }
    CpuCopier::copy_pages(d, l, m, s);
  }
  bool joins_runs(const hicache::PageLayout&) const override { return joins_; }
  std::vector<std::byte*> stored;

 private:
  bool joins_;
};

// A store of 8 pages from blocks 8..15 into a full pool of 8 whose slots an earlier 8-page
// prompt (blocks 0..7) took in order: leaf-first eviction frees them last page first. Returns
// the host addresses of the first store's pages, then of the second's, in each call's order; the
// second's pages then load back into blocks 16..23, byte for byte.
std::pair<std::vector<std::byte*>, std::vector<std::byte*>> store_into_freed_slots(bool joins) {
  FakeEngine eng(24, {64});
  for (std::int64_t b = 0; b < 16; ++b) eng.fill(b, static_cast<std::uint32_t>(b + 1));
  auto copier = std::make_shared<RunJoiningCopier>(joins);
  CacheConfig c = small_config(8);
  c.admission = hicache::Admission::kAlways;
  HostPrefixCache cache(eng.segments(), {}, c, copier);
  EXPECT_EQ(cache.store("a", tokens(8 * 16 + 1), ids(0, 8)), 8);
  cache.poll();
  cache.forget("a");
  const auto first = copier->stored;
  copier->stored.clear();
  const auto b = tokens(8 * 16 + 1, 1000);
  EXPECT_EQ(cache.store("b", b, ids(8, 8)), 8);
  cache.poll();
  cache.forget("b");
  EXPECT_EQ(cache.try_resume("c", b, give(ids(16, 8))), 8 * 16);
  cache.poll();
  for (std::int64_t i = 0; i < 8; ++i) EXPECT_EQ(eng.page(16 + i), eng.page(8 + i)) << i;
  return {first, copier->stored};
}

}  // namespace

TEST(HostPrefixCache, ACopierThatJoinsRunsGetsTheFreedSlotsInTheBlocksOrder) {
  // Without the hint the freed slots come backwards against blocks that go forwards (the
  // negative control: no two pages could join); with it, the same slots in the blocks' order.
  const auto [plain_first, plain] = store_into_freed_slots(false);
  const auto [first, joined] = store_into_freed_slots(true);
  ASSERT_EQ(plain.size(), 8u);
  ASSERT_EQ(joined.size(), 8u);
  EXPECT_TRUE(std::is_sorted(plain_first.begin(), plain_first.end()));  // a fresh pool: in order
  EXPECT_TRUE(std::is_sorted(plain.rbegin(), plain.rend())) << "the scenario lost its crossed runs";
  EXPECT_EQ(joined, first) << "not the freed slots, in the blocks' order";
}

TEST(HostPrefixCache, PoolAllocationFailureSkipsTheStore) {
  class NoMemory : public hicache::HostAllocator {
   public:
    void* allocate(std::size_t) override { throw hicache::Error("no pinned memory left"); }
    void deallocate(void*, std::size_t) noexcept override {}
    const char* name() const override { return "none"; }
  };
  FakeEngine eng(8, {64});
  auto copier = std::make_shared<hicache::CpuCopier>(std::make_shared<NoMemory>());
  HostPrefixCache cache(eng.segments(), {}, small_config(8), copier);
  EXPECT_EQ(cache.store("a", tokens(33), ids(0, 2)), 0);
  auto s = cache.stats();
  EXPECT_EQ(s.errors, 1);
  EXPECT_EQ(s.pages_used, 0);
  EXPECT_EQ(s.last_error, "no pinned memory left");
}

TEST(HostPrefixCache, ConcurrentCallsFromSeveralThreadsStayConsistent) {
  // Conversations of 3 pages and of 20-35 pages (their lookups hash in installments and walk
  // again after each, while other threads evict), in a pool of 48 pages.
  FakeEngine eng(512, {128});
  HostPrefixCache cache(eng.segments(), {}, small_config(48));
  std::atomic<int> bad{0}, long_hits{0};
  std::vector<std::thread> threads;
  for (int th = 0; th < 4; ++th) {
    threads.emplace_back([&, th] {
      std::mt19937 rng(static_cast<std::uint32_t>(th));
      const std::int64_t base = 128 * th;  // each thread owns 128 blocks
      for (int i = 0; i < 400; ++i) {
        const int conv = static_cast<int>(rng() % 8);
        const std::int64_t pages = conv < 4 ? 3 : 20 + 5 * (conv - 4);
        const auto t = tokens(static_cast<std::size_t>(16 * pages + 1), conv * 1000);
        // Blocks 0..pages-1 of conversation `conv` hold its patterns in every thread's range.
        for (std::int64_t p = 0; p < pages; ++p)
          eng.fill(base + p, static_cast<std::uint32_t>(conv * 100 + p));
        const std::string id = std::to_string(th) + ":" + std::to_string(i);
        const std::int64_t got = cache.try_resume(id, t, give(ids(base + 50, pages)));
        if (got > 16 * 16) ++long_hits;  // past the first installment of keys
        for (std::int64_t p = 0; p < got / 16; ++p) {
          if (eng.page(base + 50 + p) != eng.page(base + p)) ++bad;
        }
        cache.store(id, t, ids(base, pages + 1));
        cache.poll();
        cache.forget(id);
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(bad.load(), 0);
  EXPECT_GT(long_hits.load(), 0);
  auto s = cache.stats();
  EXPECT_EQ(s.lookups, 1600);
  EXPECT_GT(s.hits, 0);
  EXPECT_EQ(s.pages_busy, 0);
  EXPECT_EQ(s.requests, 0);
}

TEST(HostPrefixCache, StoresIntoAChunkStillBeingPinnedAreSkippedNotBlocked) {
  class SlowPinning : public hicache::HostAllocator {
   public:
    void* allocate(std::size_t bytes) override {
      std::unique_lock<std::mutex> lock(mu);
      if (++calls > 1) cv.wait(lock, [&] { return open; });
      return inner->allocate(bytes);
    }
    void deallocate(void* p, std::size_t n) noexcept override { inner->deallocate(p, n); }
    const char* name() const override { return "slow"; }
    bool allocation_is_slow() const override { return true; }
    std::shared_ptr<hicache::HostAllocator> inner = hicache::make_aligned_host_allocator();
    std::mutex mu;
    std::condition_variable cv;
    int calls = 0;
    bool open = false;
  };
  auto alloc = std::make_shared<SlowPinning>();
  FakeEngine eng(16, {256});
  CacheConfig c = small_config(8);
  c.pool_chunk_bytes = 512;  // two pages a chunk
  c.pin_upfront = false;     // grow in the background
  HostPrefixCache cache(eng.segments(), {}, c, std::make_shared<hicache::CpuCopier>(alloc));
  EXPECT_EQ(cache.store("a", tokens(3 * 16 + 1), ids(0, 4)), 2);  // third page: chunk 1 not ready
  auto s = cache.stats();
  EXPECT_EQ(s.store_skips_unpinned, 1);  // counted apart from a busy pool's skips
  EXPECT_EQ(s.store_skips, 0);
  EXPECT_EQ(s.errors, 0);
  EXPECT_EQ(s.pages_used, 2);
  {
    std::lock_guard<std::mutex> g(alloc->mu);
    alloc->open = true;
  }
  alloc->cv.notify_all();
  for (int i = 0; i < 1000 && cache.store("a", tokens(3 * 16 + 1), ids(0, 4)) == 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  EXPECT_EQ(cache.stats().pages_used, 3);
  EXPECT_EQ(cache.try_resume("b", tokens(3 * 16 + 1), give(ids(8, 3))), 48);
}

namespace {

// A pinned allocator as the cache sees one: slow (each allocation takes `delay`), counted.
class SlowPinned : public hicache::HostAllocator {
 public:
  explicit SlowPinned(std::chrono::milliseconds delay = std::chrono::milliseconds(0))
      : delay_(delay) {}
  void* allocate(std::size_t bytes) override {
    std::this_thread::sleep_for(delay_);
    if (++calls >= fail_from)
      throw hicache::Error("cudaHostRegister failed: out of memory (planned)");
    return inner->allocate(bytes);
  }
  void deallocate(void* p, std::size_t n) noexcept override { inner->deallocate(p, n); }
  const char* name() const override { return "pinned"; }
  bool allocation_is_slow() const override { return true; }
  bool room_for(std::size_t) const override { return calls < room_for_calls; }
  std::shared_ptr<hicache::HostAllocator> inner = hicache::make_aligned_host_allocator();
  std::atomic<int> calls = 0;
  std::atomic<int> room_for_calls = 1 << 30;  // the "machine" has room for this many chunks
  std::atomic<int> fail_from = 1 << 30;       // allocations from this call on fail

 private:
  std::chrono::milliseconds delay_;
};

// Polls stats until pred holds or 10 s pass.
template <typename Pred>
bool eventually(const HostPrefixCache& cache, Pred pred) {
  for (int i = 0; i < 10000; ++i) {
    if (pred(cache.stats())) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return false;
}

}  // namespace

TEST(HostPrefixCache, SlowPoolsPinTheFirstChunkAtOnceTheRestInTheBackgroundOrAllUpFront) {
  FakeEngine eng(16, {256});
  CacheConfig c = small_config(8);
  c.pool_chunk_bytes = 512;
  {
    auto lazy = std::make_shared<SlowPinned>();
    HostPrefixCache cache(eng.segments(), {}, c, std::make_shared<hicache::CpuCopier>(lazy));
    EXPECT_GE(cache.stats().host_bytes, 2 * 256);  // the first chunk, by the constructor
    // ... and the rest with no store at all: the pool does not wait for traffic to grow.
    EXPECT_TRUE(eventually(cache, [](const auto& s) { return s.host_bytes == 8 * 256; }));
    EXPECT_EQ(lazy->calls, 4);
  }
  c.pin_upfront = true;
  auto alloc = std::make_shared<SlowPinned>();
  HostPrefixCache cache(eng.segments(), {}, c, std::make_shared<hicache::CpuCopier>(alloc));
  EXPECT_EQ(alloc->calls, 4);  // every chunk, before any store
  EXPECT_EQ(cache.stats().host_bytes, 8 * 256);
  EXPECT_EQ(cache.store("a", tokens(8 * 16 + 1), ids(0, 9)), 8);
  EXPECT_EQ(alloc->calls, 4);
}

TEST(HostPrefixCache, APoolOfManyChunksIsWholeSoonAfterStartAndStoresOfSeveralChunksAreNotCut) {
  // 8 chunks of 2 pages, 1 ms to pin each; a store of 5 new pages (more than two chunks) every
  // 20 ms. Grown one chunk per burst of stores (the old behaviour), the pool cut short most of
  // the first stores; pinned ahead of demand it is whole before the second store, after which
  // no store is cut short for want of pinned memory.
  FakeEngine eng(16, {256});
  CacheConfig c = small_config(16);
  c.pool_chunk_bytes = 512;
  auto alloc = std::make_shared<SlowPinned>(std::chrono::milliseconds(1));
  HostPrefixCache cache(eng.segments(), {}, c, std::make_shared<hicache::CpuCopier>(alloc));
  int cut = 0;
  for (int round = 1; round <= 10; ++round) {
    auto prompt = tokens(5 * 16 + 1);
    for (auto& t : prompt) t += 1000 * round;  // a new prompt every round
    cut += cache.store(numbered("r", round), prompt, ids(0, 6)) < 5 ? 1 : 0;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  EXPECT_LE(cut, 1);  // at most the first, sent 0 ms after start-up
  EXPECT_EQ(cache.stats().store_skips_unpinned, cut);
  EXPECT_EQ(cache.stats().store_skips, 0);
  EXPECT_EQ(cache.stats().host_bytes, 16 * 256);
}

TEST(HostPrefixCache, BackgroundPinningPausesWhileHostMemoryIsShortAndPinsWhatIsAskedFor) {
  FakeEngine eng(16, {256});
  CacheConfig c = small_config(8);
  c.pool_chunk_bytes = 512;
  auto alloc = std::make_shared<SlowPinned>();
  alloc->room_for_calls = 2;  // room ahead of need for one chunk besides the first
  HostPrefixCache cache(eng.segments(), {}, c, std::make_shared<hicache::CpuCopier>(alloc));
  EXPECT_TRUE(eventually(cache, [](const auto& s) { return s.host_bytes == 4 * 256; }));
  std::this_thread::sleep_for(std::chrono::milliseconds(250));  // past a second look
  EXPECT_EQ(cache.stats().host_bytes, 4 * 256);                 // paused there, and says so
  EXPECT_EQ(cache.stats().host_bytes_capacity, 8 * 256);
  EXPECT_EQ(cache.stats().pinning, "waiting for memory");
  EXPECT_EQ(cache.stats().pinning_note.rfind("too little host memory to pin ahead of need: ", 0),
            0u)
      << cache.stats().pinning_note;
  // A store reaching past the pinned part asks for the next chunk, which then comes.
  EXPECT_EQ(cache.store("a", tokens(6 * 16 + 1), ids(0, 7)), 4);
  EXPECT_EQ(cache.stats().store_skips_unpinned, 1);
  EXPECT_TRUE(eventually(cache, [](const auto& s) { return s.host_bytes == 6 * 256; }));
  EXPECT_EQ(cache.store("a", tokens(6 * 16 + 1), ids(0, 7)), 2);
  // Memory comes back: the sweep resumes by itself and the pool becomes whole.
  alloc->room_for_calls = 1 << 30;
  EXPECT_TRUE(eventually(cache, [](const auto& s) { return s.host_bytes == 8 * 256; }));
  EXPECT_EQ(cache.stats().pinning, "whole");
  EXPECT_EQ(cache.stats().pinning_note, "");
}

TEST(HostPrefixCache, APinningFailureIsInTheStatsAndTheSweepResumesOnceMemoryComesBack) {
  FakeEngine eng(16, {256});
  CacheConfig c = small_config(8);
  c.pool_chunk_bytes = 512;
  auto alloc = std::make_shared<SlowPinned>();
  alloc->fail_from = 2;  // the sweep's first chunk fails (the constructor's was call 1)
  HostPrefixCache cache(eng.segments(), {}, c, std::make_shared<hicache::CpuCopier>(alloc));
  EXPECT_TRUE(eventually(cache, [](const auto& s) { return s.pinning == "stopped"; }));
  EXPECT_EQ(cache.stats().pinning_note, "cudaHostRegister failed: out of memory (planned)");
  EXPECT_EQ(cache.stats().host_bytes, 2 * 256);
  alloc->fail_from = 1 << 30;
  // The failed chunk is reported by the store that reaches it (an error, counted), then asked
  // for again; once that succeeds the sweep pins the rest by itself.
  EXPECT_EQ(cache.store("a", tokens(3 * 16 + 1), ids(0, 4)), 2);
  EXPECT_EQ(cache.stats().errors, 1);
  EXPECT_EQ(cache.store("b", tokens(3 * 16 + 1), ids(0, 4)), 0);
  EXPECT_EQ(cache.stats().store_skips_unpinned, 1);
  EXPECT_TRUE(eventually(cache, [](const auto& s) { return s.pinning == "whole"; }));
  EXPECT_EQ(cache.stats().host_bytes, 8 * 256);
}

// --- hostile input, round 2 ----------------------------------------------------------------------

TEST(HostPrefixCache, AStoreThatRaisesPublishesNothingEvenIfPolledFromItsOwnCallback) {
  FakeEngine eng(8, {64});
  CacheConfig c = small_config(8);
  c.state_bytes = 8;
  c.capacity_states = 4;
  c.state_lookback = 2;
  HostPrefixCache cache(eng.segments(), {}, c);
  std::vector<std::uint8_t> wrong(5), right(8, 1);
  const auto prompt = tokens(3 * 16 + 1);
  // The engine polls from inside its export (callbacks may call the cache), which would retire
  // and publish the pages already copied, then hands back a buffer of the wrong size.
  auto bad_export = [&](std::int64_t) -> std::optional<hicache::DeviceBuffer> {
    cache.poll();
    return hicache::DeviceBuffer{wrong.data(), wrong.size(), {}};
  };
  EXPECT_THROW(cache.store("a", prompt, ids(0, 4), nullptr, bad_export), std::invalid_argument);
  // An exception of the engine's own, on the second boundary: the first state's copy was
  // enqueued, and is discarded with the pages.
  int calls = 0;
  auto throwing_export = [&](std::int64_t) -> std::optional<hicache::DeviceBuffer> {
    if (++calls == 2) throw std::runtime_error("engine: state ring corrupted");
    return hicache::DeviceBuffer{right.data(), right.size(), {}};
  };
  EXPECT_THROW(cache.store("b", prompt, ids(0, 4), nullptr, throwing_export), std::runtime_error);
  cache.poll();
  std::vector<std::uint8_t> out(8);
  hicache::DeviceBuffer out_buf{out.data(), out.size(), {}};
  EXPECT_EQ(cache.try_resume("c", prompt, give(ids(4, 3)), nullptr, out_buf), 0);
  auto s = cache.stats();
  EXPECT_EQ(s.pages_used, 0);
  EXPECT_EQ(s.states_used, 0);
  EXPECT_EQ(s.pages_busy + s.states_busy, 0);
  EXPECT_EQ(s.transfers_in_flight, 0);
  // The cache still works: a good store publishes.
  auto good_export = [&](std::int64_t) -> std::optional<hicache::DeviceBuffer> {
    return hicache::DeviceBuffer{right.data(), right.size(), {}};
  };
  cache.store("d", prompt, ids(0, 4), nullptr, good_export);
  cache.poll();
  EXPECT_EQ(cache.try_resume("e", prompt, give(ids(4, 3)), nullptr, out_buf), 48);
}

TEST(HostPrefixCache, SaltsCostNothingOnceNoPageUsesThem) {
  FakeEngine eng(8, {64});
  HostPrefixCache cache(eng.segments(), {}, small_config(4));
  const std::string big(4096, 'x');
  // Lookups never keep a salt, hit or miss.
  for (int i = 0; i < 5000; ++i) {
    const std::string salt = big + std::to_string(i);
    EXPECT_EQ(cache.try_resume("r", tokens(40), give(ids(0, 2)), nullptr, std::nullopt, salt), 0);
  }
  EXPECT_EQ(cache.stats().salts, 0);
  // Stores keep a salt while a page uses it; once evicted, it goes at the next sweep.
  for (int i = 0; i < 5000; ++i) {
    const std::string salt = big + std::to_string(i);
    cache.store("w", tokens(17), ids(0, 2), nullptr, {}, salt);
  }
  EXPECT_LE(cache.stats().salts, 2 * 4 + 64);
  EXPECT_EQ(cache.stats().pages_used, 4);
  // The salts still in use still serve their pages, and only to themselves.
  const std::string last = big + "4999";
  EXPECT_EQ(cache.try_resume("h", tokens(17), give(ids(4, 1)), nullptr, std::nullopt, last), 16);
  EXPECT_EQ(cache.try_resume("m", tokens(17), give(ids(4, 1)), nullptr, std::nullopt, big), 0);
}

TEST(HostPrefixCache, HugeCapacitiesCostNothingUntilUsed) {
  FakeEngine eng(8, {16384});
  for (std::int64_t capacity : {std::int64_t{1} << 32, std::int64_t{1} << 40, INT64_MAX}) {
    CacheConfig c = small_config(capacity);
    HostPrefixCache cache(eng.segments(), {}, c);
    EXPECT_EQ(cache.stats().host_bytes, 0);
    EXPECT_EQ(cache.store("a", tokens(33), ids(0, 3)), 2);
    EXPECT_EQ(cache.try_resume("b", tokens(33), give(ids(4, 2))), 32);
    EXPECT_EQ(cache.stats().host_bytes, 1 << 30);  // one chunk
  }
}
