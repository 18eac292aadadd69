// PageStore: pages named by an engine's keys, gathered from pieces of its host pool, come back
// byte-equal into other pieces; every way a stored value can be wrong (another space, another
// chain, damaged, truncated, missing) is a miss, counted; tier failures are misses too.
#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "hicache/hicache.hpp"
#include "test_support.hpp"

namespace {

using hicache::MemoryTier;
using hicache::PageStore;
using hicache::PageStoreOptions;
using hicache_test::numbered;

// A host pool laid out layer-first, as SGLang's: page p's piece of layer l (K, then V) lies at
// pool[(l * 2 + kv) * slots + p] (each a `piece` bytes), so a page is 2 * layers pieces apart.
struct Pool {
  static constexpr std::size_t kLayers = 3;
  std::size_t piece, slots;
  std::vector<std::byte> bytes;
  explicit Pool(std::size_t piece_bytes, std::size_t slot_count = 8)
      : piece(piece_bytes), slots(slot_count), bytes(kLayers * 2 * slots * piece) {}
  std::uintptr_t at(std::size_t slot, std::size_t j) {
    return reinterpret_cast<std::uintptr_t>(bytes.data() + (j * slots + slot) * piece);
  }
  std::vector<std::uintptr_t> pieces(const std::vector<std::size_t>& which) {
    std::vector<std::uintptr_t> out;
    for (std::size_t s : which) {
      for (std::size_t j = 0; j < kLayers * 2; ++j) out.push_back(at(s, j));
    }
    return out;
  }
  std::vector<std::byte> page(std::size_t slot) {
    std::vector<std::byte> out;
    for (std::size_t j = 0; j < kLayers * 2; ++j) {
      const auto* p = reinterpret_cast<const std::byte*>(at(slot, j));
      out.insert(out.end(), p, p + piece);
    }
    return out;
  }
  void fill(std::uint64_t seed) {  // splitmix64, a word at a time (pools of 100 MiB, sanitized)
    std::uint64_t x = seed;
    for (std::size_t i = 0; i + 8 <= bytes.size(); i += 8) {
      std::uint64_t z = (x += 0x9e3779b97f4a7c15ULL);
      z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
      z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
      z ^= z >> 31;
      std::memcpy(bytes.data() + i, &z, 8);
    }
  }
};

PageStoreOptions options(std::size_t piece, std::string space = "model-a") {
  PageStoreOptions o;
  o.space = std::move(space);
  o.piece_bytes.assign(Pool::kLayers * 2, piece);
  return o;
}

using Keys = std::vector<std::string>;
const Keys kKeys = {"k0", "k1", "k2", "k3"};

// Pieces of 1 KiB take the one-pass gather/scatter; 100-byte pieces the copy-then-sum path.
class PageStoreTest : public ::testing::TestWithParam<std::size_t> {};

TEST_P(PageStoreTest, PagesComeBackByteEqualIntoOtherSlots) {
  auto tier = std::make_shared<MemoryTier>();
  PageStore store(tier, options(GetParam()));
  Pool a(GetParam()), b(GetParam());
  a.fill(1);
  b.fill(2);
  EXPECT_EQ(store.put(kKeys, "", a.pieces({0, 1, 2, 3})), std::vector<std::uint8_t>(4, 1));
  EXPECT_EQ(store.exists(kKeys), std::vector<std::uint8_t>(4, 1));
  EXPECT_EQ(store.get(kKeys, "", b.pieces({7, 5, 6, 4})), std::vector<std::uint8_t>(4, 1));
  EXPECT_EQ(b.page(7), a.page(0));
  EXPECT_EQ(b.page(5), a.page(1));
  EXPECT_EQ(b.page(6), a.page(2));
  EXPECT_EQ(b.page(4), a.page(3));
  // A call in the middle of the chain names its first page's parent.
  Pool c(GetParam());
  EXPECT_EQ(store.get(Keys{kKeys.begin() + 2, kKeys.end()}, "k1", c.pieces({0, 1})),
            std::vector<std::uint8_t>(2, 1));
  EXPECT_EQ(c.page(1), a.page(3));
  EXPECT_EQ(store.stats().pages_got, 6);
  EXPECT_EQ(store.stats().pages_rejected, 0);
}

INSTANTIATE_TEST_SUITE_P(PieceSizes, PageStoreTest, ::testing::Values(1024, 100));

TEST(PageStore, WrongValuesAreMissesNeverBytes) {
  auto tier = std::make_shared<MemoryTier>();
  PageStore store(tier, options(1024));
  Pool a(1024), b(1024);
  a.fill(3);
  ASSERT_EQ(store.put(kKeys, "", a.pieces({0, 1, 2, 3})), std::vector<std::uint8_t>(4, 1));

  // Another chain: the same name, read as the continuation of another prefix.
  EXPECT_EQ(store.get(Keys{kKeys[1]}, "other", b.pieces({0})), std::vector<std::uint8_t>{0});
  // Another space (model, format or rank) never sees these values, even by their names.
  PageStore other(tier, options(1024, "model-b"));
  EXPECT_EQ(other.exists(kKeys), std::vector<std::uint8_t>(4, 0));
  // Another space's value copied under this space's name: the record says whose it is.
  ASSERT_EQ(other.put(kKeys, "", a.pieces({0, 1, 2, 3})), std::vector<std::uint8_t>(4, 1));
  std::vector<std::byte> foreign;
  tier->edit(other.value_name("k2"), [&](std::vector<std::byte>& v) { foreign = v; });
  ASSERT_TRUE(tier->edit(store.value_name("k2"), [&](std::vector<std::byte>& v) { v = foreign; }));

  // A flipped byte in the page, a truncated value, a missing one.
  ASSERT_TRUE(tier->edit(store.value_name("k1"),
                         [](std::vector<std::byte>& v) { v[700] ^= std::byte{1}; }));
  ASSERT_TRUE(tier->edit(store.value_name("k3"),
                         [](std::vector<std::byte>& v) { v.resize(v.size() - 64); }));
  const auto got = store.get(kKeys, "", b.pieces({4, 5, 6, 7}));
  EXPECT_EQ(got, (std::vector<std::uint8_t>{1, 0, 0, 0}));
  EXPECT_EQ(b.page(4), a.page(0));
  EXPECT_EQ(store.stats().pages_rejected, 4);  // other chain, flipped, foreign, truncated
  ASSERT_TRUE(tier->erase(store.value_name("k0")));
  EXPECT_EQ(store.get(Keys{kKeys[0]}, "", b.pieces({0})), std::vector<std::uint8_t>{0});
  EXPECT_EQ(store.stats().pages_missing, 1);
  EXPECT_FALSE(store.stats().last_error.empty());
}

TEST(PageStore, ARejectedPageIsReportedMissingUntilWrittenAgain) {
  // Otherwise an engine that skips pages the tier holds (SGLang's backends do) would never
  // replace a damaged one: a miss for as long as the value stays.
  auto tier = std::make_shared<MemoryTier>();
  PageStore store(tier, options(1024));
  Pool a(1024), b(1024);
  a.fill(10);
  ASSERT_EQ(store.put(kKeys, "", a.pieces({0, 1, 2, 3})), std::vector<std::uint8_t>(4, 1));
  ASSERT_TRUE(
      tier->edit(store.value_name("k2"), [](std::vector<std::byte>& v) { v[9] ^= std::byte{4}; }));
  EXPECT_EQ(store.exists(kKeys), std::vector<std::uint8_t>(4, 1));  // not known to be bad yet
  EXPECT_EQ(store.get(kKeys, "", b.pieces({0, 1, 2, 3})), (std::vector<std::uint8_t>{1, 1, 0, 1}));
  EXPECT_EQ(store.exists(kKeys), (std::vector<std::uint8_t>{1, 1, 0, 1}));
  EXPECT_EQ(tier->size(), 4u);  // the damaged value is still there: only the store knows
  ASSERT_EQ(store.put(Keys{"k2"}, "k1", a.pieces({2})), std::vector<std::uint8_t>{1});
  EXPECT_EQ(store.exists(kKeys), std::vector<std::uint8_t>(4, 1));
  EXPECT_EQ(store.get(kKeys, "", b.pieces({4, 5, 6, 7})), std::vector<std::uint8_t>(4, 1));
  EXPECT_EQ(b.page(6), a.page(2));
}

TEST(PageStore, AnUnknownFirstParentChecksEverythingElse) {
  auto tier = std::make_shared<MemoryTier>();
  PageStore store(tier, options(1024));
  Pool a(1024), b(1024);
  a.fill(7);
  // Written by an engine that names the parent, read by one that does not, and the reverse.
  ASSERT_EQ(store.put(kKeys, "", a.pieces({0, 1, 2, 3})), std::vector<std::uint8_t>(4, 1));
  EXPECT_EQ(store.get(Keys{kKeys[2], kKeys[3]}, std::nullopt, b.pieces({0, 1})),
            std::vector<std::uint8_t>(2, 1));
  EXPECT_EQ(b.page(1), a.page(3));
  ASSERT_EQ(store.put(Keys{"u0", "u1"}, std::nullopt, a.pieces({0, 1})),
            std::vector<std::uint8_t>(2, 1));
  EXPECT_EQ(store.get(Keys{"u0", "u1"}, std::nullopt, b.pieces({2, 3})),
            std::vector<std::uint8_t>(2, 1));
  EXPECT_EQ(store.get(Keys{"u0"}, "", b.pieces({2})),
            std::vector<std::uint8_t>{0});  // chain differs
  // The rest of the call is still chained: u1 read after another first page is refused.
  EXPECT_EQ(store.get(Keys{"k0", "u1"}, std::nullopt, b.pieces({2, 3})),
            (std::vector<std::uint8_t>{1, 0}));
  // And the bytes are still checked.
  ASSERT_TRUE(
      tier->edit(store.value_name("u0"), [](std::vector<std::byte>& v) { v[5] ^= std::byte{1}; }));
  EXPECT_EQ(store.get(Keys{"u0"}, std::nullopt, b.pieces({2})), std::vector<std::uint8_t>{0});
}

TEST(PageStore, NegativeControlTheSameEditsUncheckedWouldServeWrongBytes) {
  // The edits above change what a reader receives: without the record a flipped byte is served.
  auto tier = std::make_shared<MemoryTier>();
  PageStore store(tier, options(1024));
  Pool a(1024);
  a.fill(4);
  ASSERT_EQ(store.put(Keys{kKeys[0]}, "", a.pieces({0})), std::vector<std::uint8_t>{1});
  std::vector<std::byte> before, after;
  tier->edit(store.value_name("k0"), [&](std::vector<std::byte>& v) { before = v; });
  tier->edit(store.value_name("k0"), [](std::vector<std::byte>& v) { v[700] ^= std::byte{1}; });
  tier->edit(store.value_name("k0"), [&](std::vector<std::byte>& v) { after = v; });
  EXPECT_NE(before, after);
  EXPECT_EQ(std::vector<std::byte>(before.begin(), before.begin() + 6 * 1024), a.page(0));
}

TEST(PageStore, ACallOfManyChunksChainsAcrossThemAndFailsOnlyTheDamagedPages) {
  // 6 MiB pages: five to a 32 MiB chunk, so 16 pages go in four batches, two in flight.
  constexpr std::size_t kPiece = std::size_t{1} << 20, kPages = 16;
  auto tier = std::make_shared<MemoryTier>();
  PageStore store(tier, options(kPiece));
  Pool a(kPiece, kPages), b(kPiece, kPages);
  a.fill(8);
  b.fill(9);
  Keys keys;
  std::vector<std::size_t> slots, reversed;
  for (std::size_t i = 0; i < kPages; ++i) {
    keys.push_back(numbered("p", i));
    slots.push_back(i);
    reversed.push_back(kPages - 1 - i);
  }
  ASSERT_EQ(store.put(keys, "", a.pieces(slots)), std::vector<std::uint8_t>(kPages, 1));
  EXPECT_GE(tier->batches(), 4);
  // Page 7 (the second chunk) damaged, page 12 (the third) missing: only they fail; the pages
  // after them still chain to the keys before them.
  ASSERT_TRUE(tier->edit(store.value_name("p7"),
                         [](std::vector<std::byte>& v) { v[4096] ^= std::byte{1}; }));
  ASSERT_TRUE(tier->erase(store.value_name("p12")));
  std::vector<std::uint8_t> want(kPages, 1);
  want[7] = want[12] = 0;
  EXPECT_EQ(store.get(keys, "", b.pieces(reversed)), want);
  for (std::size_t i = 0; i < kPages; ++i) {
    if (want[i]) {
      EXPECT_EQ(b.page(kPages - 1 - i), a.page(i)) << "page " << i;
    }
  }
  EXPECT_EQ(store.stats().pages_got, 14);
  EXPECT_EQ(store.stats().pages_rejected, 1);
  EXPECT_EQ(store.stats().pages_missing, 1);
}

TEST(PageStore, TierFailuresAreMissesAndCounted) {
  auto tier = std::make_shared<MemoryTier>();
  PageStore store(tier, options(1024));
  Pool a(1024);
  a.fill(5);
  tier->fail_next(1);
  EXPECT_EQ(store.put(kKeys, "", a.pieces({0, 1, 2, 3})), std::vector<std::uint8_t>(4, 0));
  EXPECT_EQ(store.stats().pages_put_failed, 4);
  ASSERT_EQ(store.put(kKeys, "", a.pieces({0, 1, 2, 3})), std::vector<std::uint8_t>(4, 1));
  tier->fail_next(2);
  EXPECT_EQ(store.get(kKeys, "", a.pieces({4, 5, 6, 7})), std::vector<std::uint8_t>(4, 0));
  EXPECT_EQ(store.exists(kKeys), std::vector<std::uint8_t>(4, 0));
  EXPECT_EQ(store.stats().tier_errors, 4 + 4 + 4);  // each value the tier failed to move
}

TEST(PageStore, ThreadsPutAndGetAtOnce) {
  auto tier = std::make_shared<MemoryTier>();
  PageStore store(tier, options(1024));
  Pool a(1024);
  a.fill(6);
  std::vector<std::thread> threads;
  std::vector<int> bad(4, 0);
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      Pool mine(1024);
      for (int round = 0; round < 50; ++round) {
        const std::vector<std::string> keys = {numbered(numbered("t", t) + "-", round)};
        if (store.put(keys, "", a.pieces({static_cast<std::size_t>(t)}))[0] != 1) ++bad[t];
        if (store.get(keys, "", mine.pieces({0}))[0] != 1) ++bad[t];
        if (mine.page(0) != a.page(static_cast<std::size_t>(t))) ++bad[t];
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(bad, std::vector<int>(4, 0));
}

TEST(PageStore, BadArgumentsAreNamed) {
  auto tier = std::make_shared<MemoryTier>();
  EXPECT_THROW(PageStore(nullptr, options(1024)), std::invalid_argument);
  PageStoreOptions o;
  EXPECT_THROW(PageStore(tier, o), std::invalid_argument);
  o.piece_bytes = {0};
  EXPECT_THROW(PageStore(tier, o), std::invalid_argument);
  PageStore store(tier, options(1024));
  Pool a(1024);
  try {
    store.put(kKeys, "", a.pieces({0}));
    FAIL() << "no throw";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("6 piece addresses for 4 pages"), std::string::npos);
  }
}

}  // namespace
