// A tier shared by several caches (several engine hosts): pages one stored are served to
// another, exactly; every way a shared value can be wrong is a miss; tier failures never stop
// the cache.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <thread>

#include "hicache/hicache.hpp"
#include "page_checksum.hpp"
#include "test_support.hpp"

namespace {

using hicache::CacheConfig;
using hicache::HostPrefixCache;
using hicache::MemoryTier;
using hicache_test::ids;
using hicache_test::numbered;
using hicache_test::tokens;

constexpr std::int64_t kB = 16;
constexpr std::int64_t kBlockBytes = 256;

// One engine host: a KV pool of 16 blocks (one segment) and its cache over a shared tier.
struct Host {
  std::vector<std::uint8_t> kv = std::vector<std::uint8_t>(16 * kBlockBytes);
  std::unique_ptr<HostPrefixCache> cache;

  Host(std::shared_ptr<hicache::Tier> tier, hicache::TierOptions options = {},
       std::int64_t pages = 32, std::int64_t pool_chunk_bytes = CacheConfig{}.pool_chunk_bytes) {
    CacheConfig c;
    c.block_tokens = kB;
    c.capacity_pages = pages;
    c.pool_chunk_bytes = pool_chunk_bytes;
    c.admission = hicache::Admission::kAlways;
    c.tier = std::move(options);
    cache = std::make_unique<HostPrefixCache>(
        std::vector<hicache::Segment>{{kv.data(), 16, kBlockBytes, kBlockBytes}}, hicache::Device{},
        c, nullptr, std::move(tier));
  }
  // Prefill: the KV of block i of `prompt` is a function of its tokens (as a model's is).
  void prefill(const std::vector<std::int32_t>& prompt, std::int64_t first_block) {
    for (std::size_t i = 0; i < prompt.size() / kB; ++i) {
      std::mt19937 rng(static_cast<std::uint32_t>(prompt[i * kB] * 7919 + i));
      auto* b = kv.data() + (first_block + static_cast<std::int64_t>(i)) * kBlockBytes;
      for (std::int64_t j = 0; j < kBlockBytes; ++j) b[j] = static_cast<std::uint8_t>(rng());
    }
  }
  std::vector<std::uint8_t> block(std::int64_t b) const {
    return {kv.begin() + b * kBlockBytes, kv.begin() + (b + 1) * kBlockBytes};
  }
  std::int64_t resume(const std::string& id, const std::vector<std::int32_t>& prompt,
                      std::int64_t first_block) {
    return cache->try_resume(id, prompt, [&](std::int64_t n) {
      return std::optional<std::vector<std::int64_t>>(ids(first_block, n / kB));
    });
  }
};

// Calls another backend object (a MemoryTier of its own by default): tests derive from it to
// watch the calls they care about, or use it as a second object over one store.
class ForwardingTier : public hicache::Tier {
 public:
  explicit ForwardingTier(std::shared_ptr<hicache::Tier> to = std::make_shared<MemoryTier>())
      : to_(std::move(to)) {}
  std::string name() const override { return to_->name(); }
  std::int64_t put(std::span<const std::string> n, std::span<const std::byte* const> v,
                   std::span<const std::size_t> s) override {
    return to_->put(n, v, s);
  }
  std::int64_t get(std::span<const std::string> n, std::span<std::byte* const> d,
                   std::size_t c) override {
    return to_->get(n, d, c);
  }
  std::int64_t exists(std::span<const std::string> n) override { return to_->exists(n); }
  std::optional<std::vector<std::int64_t>> poll(std::int64_t b) override { return to_->poll(b); }

 private:
  std::shared_ptr<hicache::Tier> to_;
};

// Host A prefills and stores a 5-page prompt; its pages reach the tier.
std::vector<std::int32_t> store_on(Host& a) {
  const auto prompt = tokens(5 * kB + 3, 100);
  a.prefill(prompt, 0);
  EXPECT_EQ(a.cache->store("a", prompt, ids(0, 6)), 5);
  a.cache->flush_tier();
  EXPECT_EQ(a.cache->stats().tier_pages_written, 5);
  return prompt;
}

TEST(Tier, AnotherHostIsServedWhatOneStoredByteForByte) {
  auto tier = std::make_shared<MemoryTier>();
  Host a(tier), b(tier);
  const auto prompt = store_on(a);
  EXPECT_EQ(tier->size(), 5u);
  EXPECT_EQ(b.resume("b", prompt, 8), 5 * kB);
  for (std::int64_t i = 0; i < 5; ++i) EXPECT_EQ(b.block(8 + i), a.block(i)) << "page " << i;
  auto s = b.cache->stats();
  EXPECT_EQ(s.tier_pages_fetched, 5);
  EXPECT_EQ(s.tier_hit_tokens, 5 * kB);
  EXPECT_EQ(s.pages_used, 5);  // now in B's host memory: the next hit is a host hit
  EXPECT_EQ(b.resume("b2", prompt, 8), 5 * kB);
  EXPECT_EQ(b.cache->stats().tier_pages_fetched, 5);
  // A longer prompt hits A's pages from host memory in B; its next page is nowhere.
  auto longer = prompt;
  for (int i = 0; i < 20; ++i) longer.push_back(9000 + i);
  EXPECT_EQ(b.resume("b3", longer, 8), 5 * kB);
  EXPECT_EQ(b.cache->stats().tier_pages_fetched, 5);
  EXPECT_EQ(b.cache->stats().tier_pages_missing, 1);
}

TEST(Tier, APrefixHalfInHostMemoryTakesTheRestFromTheTier) {
  auto tier = std::make_shared<MemoryTier>();
  Host a(tier), b(tier);
  const auto prompt = store_on(a);
  const std::vector<std::int32_t> head(prompt.begin(), prompt.begin() + 2 * kB + 1);
  b.prefill(head, 0);
  EXPECT_EQ(b.cache->store("h", head, ids(0, 3)), 2);
  b.cache->poll();
  EXPECT_EQ(b.resume("b", prompt, 8), 5 * kB);
  EXPECT_EQ(b.cache->stats().tier_pages_fetched, 3);
  EXPECT_EQ(b.cache->stats().tier_hit_tokens, 3 * kB);
}

// Every way the shared value can be wrong costs a miss (or a shorter hit), never a wrong page.
TEST(Tier, WrongValuesAreMissesNeverServed) {
  struct Case {
    const char* what;
    std::function<void(MemoryTier&, const std::vector<std::string>&)> damage;
    std::int64_t served;  // tokens B may serve: up to the damaged page
    bool rejected;
  };
  const std::vector<Case> cases = {
      {"intact (the control)", [](MemoryTier&, const auto&) {}, 5 * kB, false},
      {"page 2 truncated",
       [](MemoryTier& t, const auto& n) { t.edit(n[2], [](auto& v) { v.resize(v.size() - 1); }); },
       2 * kB, true},
      {"page 2 replaced by page 3's value",
       [](MemoryTier& t, const auto& n) {
         std::vector<std::byte> three;
         t.edit(n[3], [&](auto& v) { three = v; });
         t.edit(n[2], [&](auto& v) { v = three; });
       },
       2 * kB, true},
      {"one byte of page 2 flipped",
       [](MemoryTier& t, const auto& n) {
         t.edit(n[2], [](auto& v) { v.back() ^= std::byte{1}; });
       },
       2 * kB, true},
      {"page 2's tokens changed in its record",
       [](MemoryTier& t, const auto& n) {
         t.edit(n[2], [](auto& v) { v[8 + 48 + 24] ^= std::byte{4}; });
       },
       2 * kB, true},
      {"page 2 deleted after it was written", [](MemoryTier& t, const auto& n) { t.erase(n[2]); },
       2 * kB, false},
      {"page 0 deleted", [](MemoryTier& t, const auto& n) { t.erase(n[0]); }, 0, false},
  };
  for (const Case& c : cases) {
    auto tier = std::make_shared<MemoryTier>();
    Host a(tier), b(tier);
    const auto prompt = store_on(a);
    const auto keys = hicache::chain_keys("", prompt, kB);
    const auto space =
        hicache::tier_space("default", a.cache->layout(), kB, 128);  // the names A wrote
    std::vector<std::string> names;
    for (const auto& k : keys) names.push_back(hicache::tier_value_name(space, k));
    c.damage(*tier, names);
    EXPECT_EQ(b.resume("b", prompt, 8), c.served) << c.what;
    for (std::int64_t i = 0; i < c.served / kB; ++i)
      EXPECT_EQ(b.block(8 + i), a.block(i)) << c.what;
    EXPECT_EQ(b.cache->stats().tier_pages_rejected, c.rejected ? 1 : 0) << c.what;
    EXPECT_FALSE(b.cache->stats().disabled);
  }
}

TEST(Tier, ANullCopierIsRefusedATierWithAnErrorThatSaysWhy) {
  // The null copier's host slots are fake addresses: with a tier, its records and values would
  // be written there (the process crashed at the first store's write). The control: the same
  // cache without a tier (a replay's).
  std::vector<std::uint8_t> kv(16 * kBlockBytes);
  const std::vector<hicache::Segment> segs{{kv.data(), 16, kBlockBytes, kBlockBytes}};
  CacheConfig c;
  c.block_tokens = kB;
  c.capacity_pages = 8;
  auto null = std::make_shared<hicache::NullCopier>();
  try {
    HostPrefixCache cache(segs, hicache::Device{}, c, null, std::make_shared<MemoryTier>());
    ADD_FAILURE() << "a null copier was given a tier";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("null copier"), std::string::npos) << e.what();
  }
  HostPrefixCache replay(segs, hicache::Device{}, c, null);
  EXPECT_EQ(replay.store("a", tokens(3 * kB + 1, 1), ids(0, 4)), 3);
}

TEST(Tier, OtherModelsAndTenantsNeverSeeEachOthersPages) {
  auto tier = std::make_shared<MemoryTier>();
  Host a(tier);
  const auto prompt = store_on(a);
  hicache::TierOptions other;
  other.space = "another-model";
  Host b(tier, other);
  EXPECT_EQ(b.resume("b", prompt, 8), 0);
  EXPECT_EQ(b.cache->stats().tier_pages_missing, 1);
  Host c(tier);  // same model, another tenant's salt
  EXPECT_EQ(
      c.cache->try_resume(
          "c", prompt,
          [](std::int64_t n) { return std::optional<std::vector<std::int64_t>>(ids(8, n / kB)); },
          nullptr, std::nullopt, "tenant-2"),
      0);
  Host d(tier);  // the control: the same space and salt is served
  EXPECT_EQ(d.resume("d", prompt, 8), 5 * kB);
}

// A tier's record names a page's prefix by its parent's key only, so the tier is exact as long
// as chain keys do not collide: shortened keys (key_bits, which tests use to make host memory's
// collisions common) are refused with a tier.
TEST(Tier, ShortenedKeysAreRefusedSinceARecordNamesItsPrefixOnlyByItsParentsKey) {
  // Two first pages whose 2-bit keys collide, and the same second page after each.
  const auto a = tokens(kB, 1000);
  std::vector<std::int32_t> b;
  for (std::int32_t start = 2000;; start += kB) {
    b = tokens(kB, start);
    if (hicache::chain_keys("", b, kB, 1, 2)[0] == hicache::chain_keys("", a, kB, 1, 2)[0]) break;
  }
  const auto t = tokens(kB, 5000);
  auto after_a = a, after_b = b;
  after_a.insert(after_a.end(), t.begin(), t.end());
  after_b.insert(after_b.end(), t.begin(), t.end());
  // Why: the value of (a, t)'s second page passes the record check of (b, t)'s second page when
  // the keys before it collide, and only then.
  std::vector<std::uint8_t> kv(16 * kBlockBytes);
  const hicache::PageLayout layout({{kv.data(), 16, kBlockBytes, kBlockBytes}}, hicache::Device{});
  const std::vector<std::byte> page(kBlockBytes, std::byte{11});
  for (const int bits : {2, 128}) {
    const auto ka = hicache::chain_keys("", after_a, kB, 2, bits);
    const auto kb = hicache::chain_keys("", after_b, kB, 2, bits);
    const hicache::Key space = hicache::tier_space("", layout, kB, bits);
    std::vector<std::byte> value(hicache::tier_value_bytes(kB, page.size()));
    hicache::encode_tier_value(value.data(), space, ka[1], ka[0], t, page);
    std::string why;
    const bool passes =
        !hicache::check_tier_value(value, space, kb[1], kb[0], t, page.size(), why).empty();
    EXPECT_EQ(passes, bits == 2) << bits << " bits: " << why;
  }
  // So a cache with a tier refuses them, naming the option; with full keys, or without a tier,
  // the same configuration is taken.
  auto make = [&kv](int key_bits, bool with_tier) {
    CacheConfig c;
    c.block_tokens = kB;
    c.capacity_pages = 8;
    c.key_bits = key_bits;
    return HostPrefixCache(std::vector<hicache::Segment>{{kv.data(), 16, kBlockBytes, kBlockBytes}},
                           hicache::Device{}, c, nullptr,
                           with_tier ? std::make_shared<MemoryTier>() : nullptr);
  };
  try {
    make(2, true);
    ADD_FAILURE() << "a tier with 2-bit keys was taken";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("key_bits must be 128 with a tier (got 2)"),
              std::string::npos)
        << e.what();
  }
  EXPECT_NO_THROW(make(128, true));
  EXPECT_NO_THROW(make(2, false));
}

TEST(Tier, ATierThatFailsCostsMissesAndErrorsButNeverTheCache) {
  auto tier = std::make_shared<MemoryTier>();
  Host a(tier), b(tier);
  const auto prompt = store_on(a);
  tier->fail_next(20);
  for (int i = 0; i < 12; ++i) EXPECT_EQ(b.resume(numbered("b", i), prompt, 8), 0);
  auto s = b.cache->stats();
  EXPECT_EQ(s.tier_errors, 12);
  EXPECT_FALSE(s.disabled);  // tier errors are not cache errors
  EXPECT_EQ(s.errors, 0);
  // Host memory still serves, and once the tier answers again it serves too.
  b.prefill(prompt, 0);
  EXPECT_EQ(b.cache->store("b", prompt, ids(0, 6)), 5);
  b.cache->poll();
  EXPECT_EQ(b.resume("again", prompt, 8), 5 * kB);
  Host c(tier);
  tier->fail_next(0);
  EXPECT_EQ(c.resume("c", prompt, 8), 5 * kB);
}

TEST(Tier, EveryPageOfferedEndsWrittenFailedOrDroppedAndFlushSaysWhenItIsDone) {
  // The tier down while a store's pages are written: flush_tier returns once each is accounted
  // for, as failed, not before (it used to return with pages neither written nor counted).
  auto tier = std::make_shared<MemoryTier>();
  Host a(tier);
  const auto prompt = tokens(5 * kB + 3, 100);
  a.prefill(prompt, 0);
  tier->fail_next(1000);
  EXPECT_EQ(a.cache->store("a", prompt, ids(0, 6)), 5);
  EXPECT_TRUE(a.cache->flush_tier());
  auto s = a.cache->stats();
  EXPECT_EQ(s.tier_pages_failed, 5);
  EXPECT_EQ(s.tier_pages_written + s.tier_pages_failed + s.tier_pages_dropped, 5);
  EXPECT_EQ(s.tier_pages_queued, 0);
  EXPECT_EQ(s.tier_last_error, "tier put: 5 pages refused");
  tier->fail_next(0);
  const auto other = tokens(5 * kB + 3, 900);
  a.prefill(other, 0);
  EXPECT_EQ(a.cache->store("b", other, ids(0, 6)), 5);
  EXPECT_TRUE(a.cache->flush_tier(std::chrono::milliseconds(10000)));
  s = a.cache->stats();
  EXPECT_EQ(s.tier_pages_written, 5);
  EXPECT_EQ(s.tier_pages_written + s.tier_pages_failed + s.tier_pages_dropped, 10);
}

TEST(Tier, ABackendsErrorIsOneLineInTheStats) {
  // A Python backend's exception text carries its traceback; the stats keep the first line.
  class Throwing final : public ForwardingTier {
   public:
    std::int64_t put(std::span<const std::string>, std::span<const std::byte* const>,
                     std::span<const std::size_t>) override {
      throw std::runtime_error("RuntimeError: the store is gone\n\nAt:\n  mooncake.py(120): put\n");
    }
  };
  Host a(std::make_shared<Throwing>());
  const auto prompt = tokens(2 * kB + 1, 100);
  a.prefill(prompt, 0);
  a.cache->store("a", prompt, ids(0, 3));
  EXPECT_TRUE(a.cache->flush_tier());
  const auto s = a.cache->stats();
  EXPECT_EQ(s.tier_last_error, "tier put: RuntimeError: the store is gone");
  EXPECT_EQ(s.tier_pages_failed, 2);
}

TEST(Tier, AFullWriteQueueDropsPagesAndCountsThem) {
  auto tier = std::make_shared<MemoryTier>();
  hicache::TierOptions small;
  small.queue_pages = 3;
  Host a(tier, small);
  const auto prompt = tokens(5 * kB + 3, 100);
  a.prefill(prompt, 0);
  a.cache->store("a", prompt, ids(0, 6));
  a.cache->flush_tier();
  const auto s = a.cache->stats();
  EXPECT_EQ(s.tier_pages_dropped, 5);  // one store of 5 pages does not fit a queue of 3
  EXPECT_EQ(s.tier_pages_written, 0);
  EXPECT_EQ(s.pages_busy, 0);  // the dropped pages were given back
}

TEST(Tier, PrefetchServesTheNextPromptInsteadOfWaiting) {
  auto tier = std::make_shared<MemoryTier>();
  hicache::TierOptions prefetch;
  prefetch.wait_us = 0;
  Host a(tier), b(tier, prefetch);
  const auto prompt = store_on(a);
  EXPECT_EQ(b.resume("b", prompt, 8), 0);  // a host miss: nothing waits
  b.cache->flush_tier();                   // the background fetch landed
  EXPECT_EQ(b.cache->stats().tier_pages_fetched, 5);
  EXPECT_EQ(b.resume("b2", prompt, 8), 5 * kB);
  for (std::int64_t i = 0; i < 5; ++i) EXPECT_EQ(b.block(8 + i), a.block(i));
}

TEST(Tier, RecordsRejectEveryFieldThatDiffers) {
  const std::vector<std::int32_t> toks = tokens(kB);
  std::vector<std::byte> page(64);
  for (std::size_t i = 0; i < page.size(); ++i) page[i] = std::byte(i);
  hicache::Key space, key, parent, other;
  space.bytes[0] = 1;
  key.bytes[0] = 2;
  parent.bytes[0] = 3;
  other.bytes[0] = 4;
  std::vector<std::byte> v(hicache::tier_value_bytes(kB, page.size()));
  hicache::encode_tier_value(v.data(), space, key, parent, toks, page);
  std::string why;
  auto ok = hicache::check_tier_value(v, space, key, parent, toks, page.size(), why);
  ASSERT_EQ(ok.size(), page.size());
  EXPECT_EQ(std::memcmp(ok.data(), page.data(), page.size()), 0);
  EXPECT_TRUE(hicache::check_tier_value(v, other, key, parent, toks, 64, why).empty());
  EXPECT_TRUE(hicache::check_tier_value(v, space, other, parent, toks, 64, why).empty());
  EXPECT_TRUE(hicache::check_tier_value(v, space, key, other, toks, 64, why).empty());
  auto toks2 = toks;
  toks2[3] = -1;
  EXPECT_TRUE(hicache::check_tier_value(v, space, key, parent, toks2, 64, why).empty());
  EXPECT_NE(why.find("tokens"), std::string::npos);
  EXPECT_TRUE(hicache::check_tier_value(v, space, key, parent, toks, 32, why).empty());
}

// The vector form of the page checksum (AVX2 where the CPU has it) gives the portable form's
// value for every length, so hosts with and without it read each other's values; and the
// checksum changes with any change a torn or overwritten page makes.
TEST(Tier, PageChecksumsAgreeOnEveryMachineAndSeeEveryChange) {
  using hicache::detail::checksum_copy;
  using hicache::detail::checksum_copy_portable;
  std::mt19937_64 rng(5);
  std::vector<std::byte> big((1 << 20) + 4096 + 77);
  for (auto& b : big) b = std::byte(rng());
  for (std::size_t n : {0, 1, 63, 64, 65, 512, 960, 1000, 1023, 1024, 1025, 4096 + 64 + 3, 1 << 20,
                        (1 << 20) + 4096 + 77}) {
    const std::span<const std::byte> in(big.data(), n);
    const std::uint64_t sum = checksum_copy_portable(in, nullptr);
    EXPECT_EQ(checksum_copy(in, nullptr), sum) << n << " bytes";
    // Destinations on a 32-byte boundary (streamed stripe by stripe) and off one (16 past it,
    // as numpy's arrays, and others: streamed in lines of their own, with memcpy before the
    // first line boundary and after the last).
    std::vector<std::byte> buffer(n + 128, std::byte{0x5A});
    const auto base = reinterpret_cast<std::uintptr_t>(buffer.data());
    std::byte* aligned = buffer.data() + (64 - base % 64) % 64;
    for (std::size_t offset : {0, 16, 32, 48, 8}) {
      std::byte* out = aligned + offset;
      EXPECT_EQ(checksum_copy(in, out), sum) << n << " bytes at " << offset;
      EXPECT_EQ(std::memcmp(out, in.data(), n), 0) << n << " bytes at " << offset;
      EXPECT_EQ(out[n], std::byte{0x5A}) << "wrote past " << n << " bytes at " << offset;
      if (offset > 0) {
        EXPECT_EQ(out[-1], std::byte{0x5A}) << "wrote before, at " << offset;
      }
      std::fill(buffer.begin(), buffer.end(), std::byte{0x5A});
    }
  }
  // A known answer: a record written on one machine is checked on another.
  std::vector<std::byte> ramp(4096 + 100);
  for (std::size_t i = 0; i < ramp.size(); ++i) ramp[i] = std::byte(i * 31 + 7);
  EXPECT_EQ(checksum_copy(ramp, nullptr), 0x74e983cbcfaf6897ULL);
  // Every change: a flipped bit anywhere, two stripes or two blocks swapped, a zero page of
  // another length.
  const std::span<const std::byte> page(big.data(), 8192);
  const std::uint64_t h = checksum_copy(page, nullptr);
  std::vector<std::byte> copy(page.begin(), page.end());
  for (std::size_t bit = 0; bit < 8192 * 8; bit += 997) {
    copy[bit / 8] ^= std::byte(1 << (bit % 8));
    EXPECT_NE(checksum_copy(copy, nullptr), h) << "bit " << bit;
    copy[bit / 8] ^= std::byte(1 << (bit % 8));
  }
  ASSERT_EQ(checksum_copy(copy, nullptr), h);
  std::swap_ranges(copy.begin(), copy.begin() + 64, copy.begin() + 64);
  EXPECT_NE(checksum_copy(copy, nullptr), h) << "two stripes swapped";
  std::swap_ranges(copy.begin(), copy.begin() + 64, copy.begin() + 64);
  std::swap_ranges(copy.begin(), copy.begin() + 1024, copy.begin() + 1024);
  EXPECT_NE(checksum_copy(copy, nullptr), h) << "two blocks swapped";
  const std::vector<std::byte> zeros(8192 + 1024);
  EXPECT_NE(checksum_copy({zeros.data(), 8192}, nullptr),
            checksum_copy({zeros.data(), 8192 + 1024}, nullptr));
}

}  // namespace

namespace {

// A MemoryTier that records how many values each put and get moved.
class CountingTier final : public ForwardingTier {
 public:
  std::int64_t put(std::span<const std::string> names, std::span<const std::byte* const> values,
                   std::span<const std::size_t> sizes) override {
    put_sizes.push_back(names.size());
    return ForwardingTier::put(names, values, sizes);
  }
  std::int64_t get(std::span<const std::string> names, std::span<std::byte* const> dests,
                   std::size_t capacity) override {
    get_sizes.push_back(names.size());
    return ForwardingTier::get(names, dests, capacity);
  }
  std::vector<std::size_t> put_sizes, get_sizes;  // values a call, in order
};

}  // namespace

TEST(Tier, RoundsHoldWholePagesAndAreOfEqualSize) {
  // A round holds the whole buffer, 6 pages (counted in pages, not in values, which are a little
  // larger: the buffer holds 5 values), whether it is a put of pages the store summed or a get
  // whose pages' bytes the loads check: 4 pages go as one round, 7 as 4 + 3, not 6 + 1.
  auto tier = std::make_shared<CountingTier>();
  std::vector<std::uint8_t> kv(16 * kBlockBytes, 9);
  CacheConfig c;
  c.block_tokens = kB;
  c.capacity_pages = 8;
  c.admission = hicache::Admission::kAlways;
  c.tier.buffer_bytes = 2 * 3 * kBlockBytes;
  HostPrefixCache cache({{kv.data(), 16, kBlockBytes, kBlockBytes}}, hicache::Device{}, c, nullptr,
                        tier);
  ASSERT_EQ(cache.store("a", tokens(4 * kB + 1, 300), ids(0, 5)), 4);
  cache.flush_tier();
  EXPECT_EQ(tier->put_sizes, (std::vector<std::size_t>{4}));
  ASSERT_EQ(cache.store("b", tokens(7 * kB + 1, 900), ids(5, 8)), 7);
  cache.flush_tier();
  EXPECT_EQ(tier->put_sizes, (std::vector<std::size_t>{4, 4, 3}));
  EXPECT_EQ(cache.stats().tier_pages_written, 11);
  // A host that has none of them fetches the 7 the same way.
  std::vector<std::uint8_t> kv_b(16 * kBlockBytes, 0);
  HostPrefixCache b({{kv_b.data(), 16, kBlockBytes, kBlockBytes}}, hicache::Device{}, c, nullptr,
                    tier);
  EXPECT_EQ(b.try_resume("b", tokens(7 * kB + 1, 900),
                         [](std::int64_t n) {
                           return std::optional<std::vector<std::int64_t>>(ids(0, n / kB));
                         }),
            7 * kB);
  EXPECT_EQ(tier->get_sizes, (std::vector<std::size_t>{4, 3}));
  for (std::int64_t i = 0; i < 7; ++i) {
    EXPECT_TRUE(std::equal(kv_b.begin() + i * kBlockBytes, kv_b.begin() + (i + 1) * kBlockBytes,
                           kv.begin() + (5 + i) * kBlockBytes));
  }
}

namespace {

// The CPU copier, as a copier that does not sum the pages it copies (the CUDA copier's way): a
// cache's loads then sum fetched pages themselves, beside the copy.
class NonSummingCopier final : public hicache::CpuCopier {
 public:
  bool sums_pages(const hicache::PageLayout&) const override { return false; }
};

}  // namespace

TEST(Tier, ALargeRunIsCheckedOnSeveralThreadsAndEndsAtTheFirstBadPage) {
  // 16 pages of 1 MiB. A flipped byte in page 9 ends the prefix there: pages 0-8 served byte for
  // byte, page 9 never served, now or when the prompt comes again. A cache that loads layer by
  // layer checks fetched pages as they arrive (on several threads for a large run): page 9 and
  // the pages after it are never published. Others publish them unchecked and check each
  // page's bytes at its first load, where the CPU copier sums them as it copies them or, for a
  // copier that does not sum (as the CUDA copier does not), the load sums them beside the copy
  // on several threads: page 9 is found there, and the load ends before it.
  constexpr std::size_t kPage = std::size_t{1} << 20;
  enum class Check { kOnArrival, kByTheCopier, kBesideTheLoad };
  for (const Check check : {Check::kOnArrival, Check::kByTheCopier, Check::kBesideTheLoad}) {
    const bool on_load = check != Check::kOnArrival;
    for (const bool damage : {false, true}) {
      SCOPED_TRACE(std::string(check == Check::kOnArrival     ? "checked on arrival"
                               : check == Check::kByTheCopier ? "checked by the copier"
                                                              : "checked beside the load") +
                   (damage ? ", page 9 damaged" : ", intact (the control)"));
      auto tier = std::make_shared<MemoryTier>();
      CacheConfig c;
      c.block_tokens = kB;
      c.capacity_pages = 32;
      c.admission = hicache::Admission::kAlways;
      std::vector<std::uint8_t> kv_a(16 * kPage), kv_b(16 * kPage, 0);
      std::mt19937 rng(5);
      for (auto& x : kv_a) x = static_cast<std::uint8_t>(rng());
      HostPrefixCache a({{kv_a.data(), 16, kPage, kPage}}, hicache::Device{}, c, nullptr, tier);
      if (!on_load) c.layer_segments = {1};
      std::shared_ptr<hicache::Copier> copier;
      if (check == Check::kBesideTheLoad) copier = std::make_shared<NonSummingCopier>();
      HostPrefixCache b({{kv_b.data(), 16, kPage, kPage}}, hicache::Device{}, c, copier, tier);
      const auto prompt = tokens(16 * kB + 1, 7);
      ASSERT_EQ(a.store("a", prompt, ids(0, 16)), 16);
      a.flush_tier();
      ASSERT_EQ(a.stats().tier_pages_written, 16);
      if (damage) {
        const auto keys = hicache::chain_keys("", prompt, kB);
        const auto space = hicache::tier_space("default", a.layout(), kB, 128);
        ASSERT_TRUE(tier->edit(hicache::tier_value_name(space, keys[9]),
                               [](auto& v) { v[v.size() / 2] ^= std::byte{0x40}; }));
      }
      const std::int64_t good = damage ? 9 : 16;
      const auto blocks = [](std::int64_t n) {
        return std::optional<std::vector<std::int64_t>>(ids(0, n / kB));
      };
      EXPECT_EQ(b.try_resume("b", prompt, blocks), good * kB);
      EXPECT_TRUE(std::equal(kv_b.begin(), kv_b.begin() + good * kPage, kv_a.begin()));
      auto s = b.stats();
      EXPECT_EQ(s.tier_pages_rejected, damage ? 1 : 0);
      EXPECT_EQ(s.tier_pages_fetched, on_load ? 16 : good);
      b.poll();
      EXPECT_EQ(b.stats().pages_busy, 0);
      if (!on_load) {
        EXPECT_EQ(b.stats().pages_used, good);
      }
      // The prompt again: the same pages, never page 9.
      std::fill(kv_b.begin(), kv_b.end(), 0);
      EXPECT_EQ(b.try_resume("b2", prompt, blocks), good * kB);
      EXPECT_TRUE(std::equal(kv_b.begin(), kv_b.begin() + good * kPage, kv_a.begin()));
      EXPECT_EQ(b.stats().tier_pages_rejected, damage ? 2 : 0);
    }
  }
}

TEST(Tier, LoadsFromSeveralThreadsCheckTheSameFetchedPagesWithoutTheCachesLock) {
  // 16 pages fetched in the background (a prefetch) and published unchecked; then four threads
  // load the prompt at once into blocks of their own, with a copier that does not sum, so each
  // load sums the pages it was first to load from their host slots with the cache's lock
  // released. Page 9 damaged: every thread gets pages 0-8 exactly and never page 9, which is
  // rejected; intact, the control: every thread all 16. ThreadSanitizer runs this in CI.
  constexpr std::size_t kPage = std::size_t{64} << 10;
  constexpr std::int64_t kPages = 16, kThreads = 4;
  for (const bool damage : {false, true}) {
    SCOPED_TRACE(damage ? "page 9 damaged" : "intact (the control)");
    auto tier = std::make_shared<MemoryTier>();
    CacheConfig c;
    c.block_tokens = kB;
    c.capacity_pages = 32;
    c.admission = hicache::Admission::kAlways;
    std::vector<std::uint8_t> kv_a(kPages * kPage), kv_b(kThreads * kPages * kPage, 0);
    std::mt19937 rng(11);
    for (auto& x : kv_a) x = static_cast<std::uint8_t>(rng());
    HostPrefixCache a({{kv_a.data(), kPages, kPage, kPage}}, hicache::Device{}, c, nullptr, tier);
    const auto prompt = tokens(kPages * kB + 1, 3);
    ASSERT_EQ(a.store("a", prompt, ids(0, kPages)), kPages);
    a.flush_tier();
    if (damage) {
      const auto keys = hicache::chain_keys("", prompt, kB);
      const auto space = hicache::tier_space("default", a.layout(), kB, 128);
      ASSERT_TRUE(tier->edit(hicache::tier_value_name(space, keys[9]),
                             [](auto& v) { v[v.size() / 3] ^= std::byte{0x08}; }));
    }
    c.tier.wait_us = 0;  // a prefetch: the pages land unchecked, and nothing loads them yet
    HostPrefixCache b({{kv_b.data(), kThreads * kPages, kPage, kPage}}, hicache::Device{}, c,
                      std::make_shared<NonSummingCopier>(), tier);
    ASSERT_EQ(b.try_resume("prefetch", prompt,
                           [](std::int64_t) { return std::optional<std::vector<std::int64_t>>(); }),
              0);
    b.flush_tier();
    ASSERT_EQ(b.stats().tier_pages_fetched, kPages);
    const std::int64_t good = damage ? 9 : kPages;
    std::vector<std::int64_t> served(kThreads, -1);
    std::vector<std::thread> threads;
    for (std::int64_t t = 0; t < kThreads; ++t) {
      threads.emplace_back([&, t] {
        served[static_cast<std::size_t>(t)] =
            b.try_resume("t" + std::to_string(t), prompt, [t](std::int64_t n) {
              return std::optional<std::vector<std::int64_t>>(ids(t * kPages, n / kB));
            });
      });
    }
    for (auto& th : threads) th.join();
    // A thread that came after page 9 was rejected missed there and, this being a prefetching
    // cache, asked the tier for pages 9-15 again in the background: wait for that fetch too.
    b.flush_tier();
    b.poll();
    for (std::int64_t t = 0; t < kThreads; ++t) {
      EXPECT_EQ(served[static_cast<std::size_t>(t)], good * kB) << "thread " << t;
      EXPECT_TRUE(std::equal(kv_a.begin(), kv_a.begin() + good * static_cast<std::int64_t>(kPage),
                             kv_b.begin() + t * kPages * static_cast<std::int64_t>(kPage)))
          << "thread " << t;
    }
    const auto st = b.stats();
    EXPECT_EQ(st.tier_pages_rejected > 0, damage);
    EXPECT_EQ(st.tier_pages_checked_on_device, 0);
    EXPECT_EQ(st.pages_busy, 0);
    EXPECT_EQ(b.try_resume("again", prompt,
                           [](std::int64_t n) {
                             return std::optional<std::vector<std::int64_t>>(ids(0, n / kB));
                           }),
              good * kB);
  }
}

TEST(Tier, APageThatFailsItsCheckBesideAnAsynchronousLoadLeavesOnlyOnceTheLoadEnded) {
  // A copier whose copies run later (as a GPU's do; DeferredCopier runs them when a fence is
  // waited for) does not sum pages: try_resume sums the fetched pages beside the load it
  // enqueued. Page 2's value is damaged: the hit ends before it, and page 2 leaves host memory,
  // its slot free for the next store, so the call first waits for the load still reading it (no
  // copy left queued). The control, intact: every page served, the load left to run (queued).
  for (const bool damage : {false, true}) {
    SCOPED_TRACE(damage ? "page 2 damaged" : "intact (the control)");
    auto tier = std::make_shared<MemoryTier>();
    Host a(tier);
    const auto prompt = store_on(a);
    if (damage) {
      const auto keys = hicache::chain_keys("", prompt, kB);
      const auto space = hicache::tier_space("default", a.cache->layout(), kB, 128);
      ASSERT_TRUE(tier->edit(hicache::tier_value_name(space, keys[2]),
                             [](auto& v) { v[kBlockBytes / 2] ^= std::byte{0x10}; }));
    }
    std::vector<std::uint8_t> kv(16 * kBlockBytes, 0);
    CacheConfig c;
    c.block_tokens = kB;
    c.capacity_pages = 32;
    c.admission = hicache::Admission::kAlways;
    auto deferred = std::make_shared<hicache::DeferredCopier>();
    HostPrefixCache b({{kv.data(), 16, kBlockBytes, kBlockBytes}}, hicache::Device{}, c, deferred,
                      tier);
    const std::int64_t good = damage ? 2 : 5;
    EXPECT_EQ(b.try_resume("b", prompt,
                           [](std::int64_t n) {
                             return std::optional<std::vector<std::int64_t>>(ids(8, n / kB));
                           }),
              good * kB);
    EXPECT_EQ(b.stats().tier_pages_rejected, damage ? 1 : 0);
    EXPECT_EQ(b.stats().tier_pages_checked_on_device, 0);  // on the page threads
    EXPECT_EQ(deferred->pending() == 0, damage);
    deferred->complete();
    for (std::int64_t i = 0; i < good; ++i) {
      EXPECT_TRUE(std::equal(kv.begin() + (8 + i) * kBlockBytes, kv.begin() + (9 + i) * kBlockBytes,
                             a.block(i).begin()))
          << "page " << i;
    }
  }
}

namespace {

// A tier whose batches complete `delay` after they start (a network), counting polls; it can
// block in wait() until a batch is due, or not (then hicache polls it).
class SlowTier final : public hicache::Tier {
 public:
  using Clock = std::chrono::steady_clock;
  SlowTier(Clock::duration delay, bool blocks, bool lies = false)
      : delay_(delay), blocks_(blocks), lies_(lies) {}
  std::string name() const override { return "slow"; }
  std::int64_t put(std::span<const std::string> names, std::span<const std::byte* const> values,
                   std::span<const std::size_t> sizes) override {
    return started(inner.put(names, values, sizes));
  }
  std::int64_t get(std::span<const std::string> names, std::span<std::byte* const> dests,
                   std::size_t capacity) override {
    return started(inner.get(names, dests, capacity));
  }
  std::int64_t exists(std::span<const std::string> names) override {
    return started(inner.exists(names));
  }
  std::optional<std::vector<std::int64_t>> poll(std::int64_t batch) override {
    ++polls;
    if (Clock::now() < due(batch)) return std::nullopt;
    std::lock_guard<std::mutex> g(mu_);
    if (due_.erase(batch) == 0) return std::nullopt;
    return inner.poll(batch);
  }
  bool wait(std::int64_t batch, std::chrono::microseconds timeout) override {
    if (!blocks_) return false;
    ++waits;
    if (!lies_) std::this_thread::sleep_until(std::min(due(batch), Clock::now() + timeout));
    return true;
  }
  MemoryTier inner;
  std::atomic<int> polls{0}, waits{0};
  std::size_t most_in_flight = 0;  // batches started and not yet polled to completion

 private:
  std::int64_t started(std::int64_t batch) {
    std::lock_guard<std::mutex> g(mu_);
    due_[batch] = Clock::now() + delay_;
    most_in_flight = std::max(most_in_flight, due_.size());
    return batch;
  }
  Clock::time_point due(std::int64_t batch) {
    std::lock_guard<std::mutex> g(mu_);
    auto it = due_.find(batch);
    return it == due_.end() ? Clock::time_point{} : it->second;
  }
  Clock::duration delay_;
  bool blocks_;
  bool lies_;  // wait() returns at once, saying it blocked
  std::mutex mu_;
  std::map<std::int64_t, Clock::time_point> due_;
};

}  // namespace

// A backend that can block is waited on, not polled: a put and a fetch of 20 ms each cost two
// polls a batch (before and after the wait) where a backend that cannot block is polled every
// 100 us. A wait never outlasts the caller's deadline.
TEST(Tier, ATierThatCanBlockIsWaitedOnInsteadOfPolled) {
  using namespace std::chrono_literals;
  const auto prompt = tokens(5 * kB + 3, 100);
  for (const bool blocks : {true, false}) {
    SCOPED_TRACE(blocks ? "blocks" : "cannot block (the control)");
    auto tier = std::make_shared<SlowTier>(20ms, blocks);
    hicache::TierOptions options;
    options.wait_us = 1'000'000;
    Host a(tier, options), b(tier, options);
    ASSERT_EQ(store_on(a), prompt);
    EXPECT_EQ(b.resume("b", prompt, 0), 5 * kB);
    for (std::int64_t i = 0; i < 5; ++i) EXPECT_EQ(b.block(i), a.block(i)) << i;
    if (blocks) {
      EXPECT_GE(tier->waits, 2);  // one put, one get
      EXPECT_LE(tier->waits, 3);
      EXPECT_LE(tier->polls, 5);
    } else {
      EXPECT_EQ(tier->waits, 0);
      EXPECT_GT(tier->polls, 40);
    }
  }
  // A backend whose wait() returns at once while saying it blocked is polled with pauses (at
  // most two polls per pause of up to 100 us), not spun on: a 20 ms put polled 110731 times
  // without the pauses.
  {
    auto liar = std::make_shared<SlowTier>(20ms, true, true);
    Host a(liar);
    store_on(a);
    EXPECT_LT(liar->polls, 1000);
    EXPECT_GT(liar->polls, 40);
  }
  // The caller's deadline bounds the wait: a fetch of a batch due in 400 ms gives up after 10.
  auto tier = std::make_shared<SlowTier>(400ms, true);
  hicache::TierOptions options;
  options.wait_us = 10'000;
  Host b(tier, options);
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_EQ(b.resume("late", prompt, 0), 0);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 200ms);
  EXPECT_EQ(b.cache->stats().tier_fetches_late, 1);
}

// Puts and gets go in rounds with one batch in flight at a time (the next round is encoded, or
// the last one checked, meanwhile): Mooncake's client moves two batches at once slower than one
// after the other. 7 pages in rounds of 3 + 2 + 2, each batch taking 5 ms.
TEST(Tier, OneRoundIsInFlightAtATime) {
  using namespace std::chrono_literals;
  auto tier = std::make_shared<SlowTier>(5ms, true);
  CacheConfig c;
  c.block_tokens = kB;
  c.capacity_pages = 16;
  c.admission = hicache::Admission::kAlways;
  c.tier.buffer_bytes = 2 * 3 * kBlockBytes;
  c.tier.wait_us = 1'000'000;
  std::vector<std::uint8_t> kv_a(16 * kBlockBytes), kv_b(16 * kBlockBytes, 0);
  for (std::size_t i = 0; i < kv_a.size(); ++i) kv_a[i] = static_cast<std::uint8_t>(i * 7 + 3);
  HostPrefixCache a({{kv_a.data(), 16, kBlockBytes, kBlockBytes}}, hicache::Device{}, c, nullptr,
                    tier);
  const auto prompt = tokens(7 * kB + 1, 500);
  ASSERT_EQ(a.store("a", prompt, ids(0, 8)), 7);
  a.flush_tier();
  EXPECT_EQ(a.stats().tier_pages_written, 7);
  EXPECT_EQ(tier->most_in_flight, 1u) << "puts";
  HostPrefixCache b({{kv_b.data(), 16, kBlockBytes, kBlockBytes}}, hicache::Device{}, c, nullptr,
                    tier);
  EXPECT_EQ(b.try_resume("b", prompt,
                         [](std::int64_t n) {
                           return std::optional<std::vector<std::int64_t>>(ids(0, n / kB));
                         }),
            7 * kB);
  EXPECT_TRUE(std::equal(kv_a.begin(), kv_a.begin() + 7 * kBlockBytes, kv_b.begin()));
  EXPECT_EQ(b.stats().tier_pages_fetched, 7);
  EXPECT_EQ(tier->most_in_flight, 1u) << "gets";
}

TEST(Tier, APageSummedInPiecesHasTheWholePagesChecksum) {
  // A layer-major page reaches its slot segment by segment: summed piece by piece (whole
  // kilobytes but the last), it has the checksum and the bytes of the page summed at once.
  using hicache::detail::ChecksumCopy;
  std::vector<std::byte> page(5 * 1024 + 77);
  std::mt19937 rng(11);
  for (auto& b : page) b = static_cast<std::byte>(rng());
  const std::uint64_t whole = hicache::page_checksum(page);
  for (const std::vector<std::size_t>& pieces :
       {std::vector<std::size_t>{1024, 1024, 3 * 1024 + 77},
        {2048, 3 * 1024, 77},
        {5 * 1024 + 77}}) {
    ChecksumCopy sum;
    std::vector<std::byte> out(page.size());
    std::size_t at = 0;
    for (std::size_t n : pieces) {
      ASSERT_TRUE(sum.add({page.data() + at, n}, out.data() + at));
      at += n;
    }
    EXPECT_EQ(sum.value(), whole) << pieces.size() << " pieces";
    EXPECT_EQ(out, page);
  }
  // A piece after one that was not whole kilobytes is refused (nothing copied).
  ChecksumCopy sum;
  std::vector<std::byte> out(page.size());
  ASSERT_TRUE(sum.add({page.data(), 1000}, out.data()));
  EXPECT_FALSE(sum.add({page.data() + 1000, 1000}, out.data() + 1000));
  EXPECT_EQ(out[1500], std::byte{0});
}

namespace {

// A MemoryTier that records the memory it was told about and checks that every value put or got
// lies in it.
class RegionTier final : public ForwardingTier {
 public:
  std::int64_t put(std::span<const std::string> names, std::span<const std::byte* const> values,
                   std::span<const std::size_t> sizes) override {
    for (std::size_t i = 0; i < values.size(); ++i) check(values[i], sizes[i]);
    return ForwardingTier::put(names, values, sizes);
  }
  std::int64_t get(std::span<const std::string> names, std::span<std::byte* const> dests,
                   std::size_t capacity) override {
    for (std::byte* d : dests) check(d, capacity);
    return ForwardingTier::get(names, dests, capacity);
  }
  void use_memory(std::span<std::byte> region) override {
    std::lock_guard<std::mutex> g(mu);
    regions.emplace(region.data(), region.size());
    ++used;
  }
  void release_memory(std::span<std::byte> region) override {
    std::lock_guard<std::mutex> g(mu);
    EXPECT_EQ(regions.erase(region.data()), 1u);
  }
  void check(const std::byte* p, std::size_t n) {
    std::lock_guard<std::mutex> g(mu);
    auto it = regions.upper_bound(p);
    const bool inside = it != regions.begin() && (--it, p + n <= it->first + it->second);
    if (inside) {
      ++inside_calls;
    } else {
      ++outside_calls;
    }
  }
  std::mutex mu;
  std::map<const std::byte*, std::size_t> regions;
  int used = 0, inside_calls = 0, outside_calls = 0;
};

}  // namespace

TEST(Tier, ValuesGoStraightFromAndIntoHostSlotsTheTierWasToldAbout) {
  // Puts read each value (the page, then its record) where the page lies in its host slot, and
  // gets write it there: no copy of the pages in between. The tier is told about the pool's
  // memory chunk by chunk (4 chunks of 2 slots here) and about nothing else, and every chunk is
  // released when the caches go.
  auto tier = std::make_shared<RegionTier>();
  {
    const std::size_t slot = kBlockBytes + hicache::tier_record_bytes(kB);
    const auto chunk = static_cast<std::int64_t>(2 * ((slot + 255) / 256 * 256));
    Host a(tier, {}, 8, chunk), b(tier, {}, 8, chunk);
    const auto prompt = tokens(7 * kB + 1, 40);
    a.prefill(prompt, 0);
    ASSERT_EQ(a.cache->store("a", prompt, ids(0, 7)), 7);
    a.cache->flush_tier();
    ASSERT_EQ(a.cache->stats().tier_pages_written, 7);
    EXPECT_EQ(b.resume("b", prompt, 0), 7 * kB);
    for (std::int64_t i = 0; i < 7; ++i) EXPECT_EQ(b.block(i), a.block(i)) << i;
    EXPECT_EQ(tier->used, 8);  // 4 chunks in each cache's pool, and nothing else
    EXPECT_GE(tier->inside_calls, 14);
    EXPECT_EQ(tier->outside_calls, 0);
  }
  EXPECT_TRUE(tier->regions.empty());
}

namespace {

// The CPU copier, but the checksums it reports for the pages it stores are off by one bit.
class MisSummingCopier final : public hicache::CpuCopier {
 public:
  void copy_pages(hicache::Direction dir, const hicache::PageLayout& layout,
                  std::span<const hicache::PageMove> moves, hicache::StreamHandle stream) override {
    CpuCopier::copy_pages(dir, layout, moves, stream);
    for (const hicache::PageMove& m : moves) {
      if (m.checksum != nullptr && m.checksum->has_value()) **m.checksum ^= 1;
    }
  }
};

// Host A (over `copier`, the CPU copier if null) stores a 3-page prompt into a shared tier, in
// pages of `segment_bytes` segments; host B (the CPU copier) resumes it from the tier: served
// byte for byte, or (`served` false) its first page rejected and nothing served.
void expect_served_through_tier(const std::vector<std::int64_t>& segment_bytes,
                                std::shared_ptr<hicache::Copier> copier, bool served) {
  auto tier = std::make_shared<MemoryTier>();
  CacheConfig c;
  c.block_tokens = kB;
  c.capacity_pages = 8;
  c.admission = hicache::Admission::kAlways;
  std::vector<std::vector<std::uint8_t>> a_kv, b_kv;
  std::vector<hicache::Segment> a_segs, b_segs;
  for (std::int64_t bytes : segment_bytes) {
    a_kv.emplace_back(static_cast<std::size_t>(8 * bytes));
    for (std::size_t i = 0; i < a_kv.back().size(); ++i) {
      a_kv.back()[i] = static_cast<std::uint8_t>(i * 31 + bytes);
    }
    b_kv.emplace_back(static_cast<std::size_t>(8 * bytes), 0);
    a_segs.push_back({a_kv.back().data(), 8, bytes, bytes});
    b_segs.push_back({b_kv.back().data(), 8, bytes, bytes});
  }
  HostPrefixCache a(a_segs, hicache::Device{}, c, std::move(copier), tier);
  HostPrefixCache b(b_segs, hicache::Device{}, c, nullptr, tier);
  const auto prompt = tokens(3 * kB + 1, 60);
  ASSERT_EQ(a.store("a", prompt, ids(0, 3)), 3);
  a.flush_tier();
  ASSERT_EQ(a.stats().tier_pages_written, 3);
  const auto got = b.try_resume("b", prompt, [](std::int64_t n) {
    return std::optional<std::vector<std::int64_t>>(ids(0, n / kB));
  });
  EXPECT_EQ(got, served ? 3 * kB : 0);
  EXPECT_EQ(b.stats().tier_pages_rejected, served ? 0 : 1);
  if (served) {
    for (std::size_t s = 0; s < a_kv.size(); ++s) {
      const auto n = static_cast<std::size_t>(3 * segment_bytes[s]);
      EXPECT_TRUE(std::equal(b_kv[s].begin(), b_kv[s].begin() + n, a_kv[s].begin()));
    }
  }
}

}  // namespace

TEST(Tier, APageTheStoreSummedIsNotReadAgainToBeWritten) {
  // The CPU copier sums each page as it copies it into its slot, and the tier record takes that
  // sum: a copier that reports a wrong one gets its values rejected by readers, which shows the
  // page was not summed again. Layouts whose segments are not whole kilobytes (but the last) are
  // summed by the tier thread instead, and read back exactly.
  struct Case {
    const char* what;
    std::vector<std::int64_t> segment_bytes;
    bool wrong_sums;
    bool served;
  };
  for (const Case& k : {Case{"two segments of 1 KiB", {1024, 1024}, false, true},
                        Case{"two segments of 1 KiB, wrong sums", {1024, 1024}, true, false},
                        Case{"1000 + 1048 bytes: summed after", {1000, 1048}, true, true}}) {
    SCOPED_TRACE(k.what);
    std::shared_ptr<hicache::Copier> copier;
    if (k.wrong_sums) copier = std::make_shared<MisSummingCopier>();
    expect_served_through_tier(k.segment_bytes, copier, k.served);
  }
}

namespace {

// The CPU copier as a copier that sums stores on the device (the CUDA copier's way): each
// stored page's checksum lands at its PageMove::sum_at_fence only when a fence recorded after
// the store is first seen done, as a device's write does; until then the sums hold a value no
// page has. `flip` reports each sum off by one bit.
class DeviceSummingCopier final : public hicache::CpuCopier {
 public:
  explicit DeviceSummingCopier(bool flip) : flip_(flip) {}
  bool sums_pages(const hicache::PageLayout&) const override { return false; }
  bool sums_on_device(const hicache::PageLayout& layout) const override {
    const auto& segs = layout.segments();
    for (std::size_t s = 0; s + 1 < segs.size(); ++s) {
      if (segs[s].block_bytes % 1024 != 0) return false;
    }
    return true;
  }
  void copy_pages(hicache::Direction dir, const hicache::PageLayout& layout,
                  std::span<const hicache::PageMove> moves, hicache::StreamHandle stream) override {
    CpuCopier::copy_pages(dir, layout, moves, stream);
    for (const hicache::PageMove& m : moves) {
      if (m.sum_at_fence == nullptr) continue;
      ++asked;
      *m.sum_at_fence = 0x5eed;  // what a slot holds before the device's write
      const auto sum =
          hicache::page_checksum({m.host, static_cast<std::size_t>(layout.page_bytes())});
      pending_.push_back({m.sum_at_fence, flip_ ? sum ^ 1 : sum});
    }
  }
  std::unique_ptr<hicache::Fence> record(hicache::StreamHandle) override {
    return std::make_unique<Landing>(std::move(pending_));
  }
  int asked = 0;

 private:
  struct Landing final : hicache::Fence {
    explicit Landing(std::vector<std::pair<std::uint64_t*, std::uint64_t>> w)
        : writes(std::move(w)) {}
    bool done() override {
      for (auto [at, sum] : writes) *at = sum;
      writes.clear();
      return true;
    }
    void wait() noexcept override { done(); }
    std::vector<std::pair<std::uint64_t*, std::uint64_t>> writes;
  };
  bool flip_;
  std::vector<std::pair<std::uint64_t*, std::uint64_t>> pending_;
};

}  // namespace

TEST(Tier, APageTheDeviceSummedIsNotReadAgainToBeWritten) {
  // A copier that sums stores on the device (the CUDA copier) writes each page's checksum into
  // a per-slot array of the cache once the store's fence is done, and the record takes it from
  // there: wrong sums get the values rejected by readers (so the tier thread did not sum the
  // page again), and a cache that read them before the fence would write the placeholder.
  // Layouts the device cannot sum (segments not whole kilobytes but the last) are summed by the
  // tier thread, and read back exactly.
  struct Case {
    const char* what;
    std::vector<std::int64_t> segment_bytes;
    bool wrong_sums;
    bool device_sums;
    bool served;
  };
  for (const Case& k : {Case{"two segments of 1 KiB", {1024, 1024}, false, true, true},
                        Case{"one segment of 1000 bytes", {1000}, false, true, true},
                        Case{"two segments of 1 KiB, wrong sums", {1024, 1024}, true, true, false},
                        Case{"1000 + 1048 bytes: summed after", {1000, 1048}, true, false, true}}) {
    SCOPED_TRACE(k.what);
    auto copier = std::make_shared<DeviceSummingCopier>(k.wrong_sums);
    expect_served_through_tier(k.segment_bytes, copier, k.served);
    EXPECT_EQ(copier->asked, k.device_sums ? 3 : 0);
  }
}

namespace {

// A tier whose gets write their values only when they complete, `delay` after they start (as a
// network's do), and never block.
class LateWritingTier final : public hicache::Tier {
 public:
  using Clock = std::chrono::steady_clock;
  explicit LateWritingTier(Clock::duration d) : delay(d) {}
  std::string name() const override { return "late"; }
  std::int64_t put(std::span<const std::string> names, std::span<const std::byte* const> values,
                   std::span<const std::size_t> sizes) override {
    return inner.put(names, values, sizes);
  }
  std::int64_t get(std::span<const std::string> names, std::span<std::byte* const> dests,
                   std::size_t capacity) override {
    std::lock_guard<std::mutex> g(mu_);
    const std::int64_t id = next_++;
    gets_[id] = {{names.begin(), names.end()},
                 {dests.begin(), dests.end()},
                 capacity,
                 Clock::now() + delay.load()};
    return id;
  }
  std::int64_t exists(std::span<const std::string> names) override { return inner.exists(names); }
  std::optional<std::vector<std::int64_t>> poll(std::int64_t batch) override {
    std::unique_lock<std::mutex> g(mu_);
    auto it = gets_.find(batch);
    if (it == gets_.end()) return inner.poll(batch);
    if (Clock::now() < it->second.due) return std::nullopt;
    Get get = std::move(it->second);
    gets_.erase(it);
    g.unlock();
    auto r = inner.poll(inner.get(get.names, get.dests, get.capacity));  // writes the slots now
    ++landed;
    return r;
  }
  MemoryTier inner;
  std::atomic<Clock::duration> delay;
  std::atomic<int> landed{0};

 private:
  struct Get {
    std::vector<std::string> names;
    std::vector<std::byte*> dests;
    std::size_t capacity;
    Clock::time_point due;
  };
  std::mutex mu_;
  std::map<std::int64_t, Get> gets_;
  std::int64_t next_ = 1'000'000;
};

}  // namespace

TEST(Tier, SlotsOfAGetGivenUpOnAreNotReusedBeforeItEnds) {
  // A host miss waits 10 ms for a get that writes its 5 values into host slots 150 ms later.
  // Until then those slots stay taken: a store of 8 new pages into the 8-slot pool gets only the
  // 3 others (were they given back at the deadline, it would get all 8, and the late values would
  // land on its pages). Once the get ended, its pages are dropped (not served unchecked), the
  // stored pages are intact, and the prompt is fetched again in full.
  using namespace std::chrono_literals;
  auto tier = std::make_shared<LateWritingTier>(150ms);
  CacheConfig c;
  c.block_tokens = kB;
  c.admission = hicache::Admission::kAlways;
  c.capacity_pages = 16;
  std::vector<std::uint8_t> kv_a(16 * kBlockBytes);
  for (std::size_t i = 0; i < kv_a.size(); ++i) kv_a[i] = static_cast<std::uint8_t>(i * 5 + 1);
  HostPrefixCache a({{kv_a.data(), 16, kBlockBytes, kBlockBytes}}, hicache::Device{}, c, nullptr,
                    tier);
  const auto prompt = tokens(5 * kB + 1, 70);
  ASSERT_EQ(a.store("a", prompt, ids(0, 5)), 5);
  a.flush_tier();
  ASSERT_EQ(a.stats().tier_pages_written, 5);

  c.capacity_pages = 8;
  c.tier.wait_us = 10'000;
  std::vector<std::uint8_t> kv_b(16 * kBlockBytes, 0);
  HostPrefixCache b({{kv_b.data(), 16, kBlockBytes, kBlockBytes}}, hicache::Device{}, c, nullptr,
                    tier);
  const auto blocks = [](std::int64_t n) {
    return std::optional<std::vector<std::int64_t>>(ids(0, n / kB));
  };
  EXPECT_EQ(b.try_resume("late", prompt, blocks), 0);
  EXPECT_EQ(b.stats().tier_fetches_late, 1);
  EXPECT_EQ(tier->landed, 0);

  const auto other = tokens(8 * kB + 1, 900);
  for (std::size_t i = 0; i < 8 * kBlockBytes; ++i) {
    kv_b[8 * kBlockBytes + i] = static_cast<std::uint8_t>(i * 3 + 2);
  }
  EXPECT_EQ(b.store("other", other, ids(8, 8)), 3);
  b.flush_tier();
  std::this_thread::sleep_for(200ms);  // the late get writes its slots

  // The next fetch first sees the late get ended and drops its pages, then runs (at once now).
  std::fill(kv_b.begin(), kv_b.begin() + 8 * kBlockBytes, 0);
  tier->delay = 0ms;
  EXPECT_EQ(b.try_resume("again", prompt, blocks), 5 * kB);
  EXPECT_EQ(tier->landed, 2);
  EXPECT_TRUE(std::equal(kv_b.begin(), kv_b.begin() + 5 * kBlockBytes, kv_a.begin()));
  // The 3 stored pages still read back as stored.
  std::fill(kv_b.begin() + 8 * kBlockBytes, kv_b.end(), 0);
  EXPECT_EQ(b.try_resume("other again", other,
                         [](std::int64_t n) {
                           return std::optional<std::vector<std::int64_t>>(ids(8, n / kB));
                         }),
            3 * kB);
  for (std::size_t i = 0; i < 3 * kBlockBytes; ++i) {
    ASSERT_EQ(kv_b[8 * kBlockBytes + i], static_cast<std::uint8_t>(i * 3 + 2)) << i;
  }
}

namespace {

// A MemoryTier that notes the most calls it ever had running at once (wait aside); each put and
// get takes a little while, as a network's would.
class OverlapTier final : public ForwardingTier {
 public:
  std::int64_t put(std::span<const std::string> names, std::span<const std::byte* const> values,
                   std::span<const std::size_t> sizes) override {
    Call c(*this);
    return ForwardingTier::put(names, values, sizes);
  }
  std::int64_t get(std::span<const std::string> names, std::span<std::byte* const> dests,
                   std::size_t capacity) override {
    Call c(*this);
    return ForwardingTier::get(names, dests, capacity);
  }
  std::int64_t exists(std::span<const std::string> names) override {
    Call c(*this);
    return ForwardingTier::exists(names);
  }
  std::optional<std::vector<std::int64_t>> poll(std::int64_t batch) override {
    Call c(*this);
    return ForwardingTier::poll(batch);
  }
  std::atomic<int> running{0}, most{0};

 private:
  struct Call {
    explicit Call(OverlapTier& t) : t_(t) {
      const int now = ++t_.running;
      int seen = t_.most.load();
      while (now > seen && !t_.most.compare_exchange_weak(seen, now)) {
      }
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
    ~Call() { --t_.running; }
    OverlapTier& t_;
  };
};

}  // namespace

TEST(Tier, CachesSharingABackendNeverCallItTwiceAtOnce) {
  // Two caches over one backend object, each stored into and read from by its own thread while
  // their tier threads write: the backend never has two calls running. The control gives each
  // cache its own object forwarding to the same backend, which hicache cannot tell apart from two
  // stores: there, calls overlap (which shows the count sees it when they do).
  for (const bool shared : {true, false}) {
    SCOPED_TRACE(shared ? "one backend object" : "two objects over it (the control)");
    auto tier = std::make_shared<OverlapTier>();
    std::shared_ptr<hicache::Tier> for_a = tier, for_b = tier;
    if (!shared) {
      for_a = std::make_shared<ForwardingTier>(tier);
      for_b = std::make_shared<ForwardingTier>(tier);
    }
    CacheConfig c;
    c.block_tokens = kB;
    c.capacity_pages = 8;
    c.admission = hicache::Admission::kAlways;
    std::vector<std::uint8_t> kv_a(16 * kBlockBytes, 1), kv_b(16 * kBlockBytes, 2);
    HostPrefixCache a({{kv_a.data(), 16, kBlockBytes, kBlockBytes}}, hicache::Device{}, c, nullptr,
                      for_a);
    HostPrefixCache b({{kv_b.data(), 16, kBlockBytes, kBlockBytes}}, hicache::Device{}, c, nullptr,
                      for_b);
    auto work = [&](HostPrefixCache& cache, std::int32_t base) {
      for (std::int32_t i = 0; i < 40; ++i) {
        const auto prompt = tokens(4 * kB + 1, base + i * 1000);
        cache.store("s", prompt, ids(0, 4));
        cache.poll();
        cache.forget("s");
        cache.try_resume("r", tokens(4 * kB + 1, (base ^ 1) + i * 1000), [](std::int64_t n) {
          return std::optional<std::vector<std::int64_t>>(ids(8, n / kB));
        });
        cache.poll();
        cache.forget("r");
      }
    };
    std::thread ta([&] { work(a, 10); });
    std::thread tb([&] { work(b, 11); });
    ta.join();
    tb.join();
    a.flush_tier();
    b.flush_tier();
    if (shared) {
      EXPECT_EQ(tier->most, 1);
    } else {
      EXPECT_GT(tier->most, 1);
    }
  }
}

TEST(Tier, FlushTierGivesUpAtItsTimeoutAndSaysHowManyPagesAreStillOnTheirWay) {
  using namespace std::chrono_literals;
  auto slow = std::make_shared<SlowTier>(2s, /*blocks=*/true);
  Host a(slow);
  const auto prompt = tokens(5 * kB + 3, 100);
  a.prefill(prompt, 0);
  EXPECT_EQ(a.cache->store("a", prompt, ids(0, 6)), 5);
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_FALSE(a.cache->flush_tier(100ms));
  EXPECT_LT(std::chrono::steady_clock::now() - t0, 1500ms);
  EXPECT_EQ(a.cache->stats().tier_pages_queued, 5);
  EXPECT_TRUE(a.cache->flush_tier());  // and, waited for, they are written
  EXPECT_EQ(a.cache->stats().tier_pages_written, 5);
  EXPECT_EQ(a.cache->stats().tier_pages_queued, 0);
}

TEST(Tier, AStoreOfferedInInstallmentsGoesToTheTierAsOnePut) {
  // A 64-page store is hashed and copied in installments (16, 16, 32 pages); the tier thread
  // takes the installments queued together as one write, so the tier sees one put of 64 values
  // (one round: the default buffer holds 64 MiB a round), not three puts one after another.
  auto tier = std::make_shared<CountingTier>();
  std::vector<std::uint8_t> kv(64 * kBlockBytes);
  for (std::size_t i = 0; i < kv.size(); ++i) kv[i] = static_cast<std::uint8_t>(i * 13 + 1);
  CacheConfig c;
  c.block_tokens = kB;
  c.capacity_pages = 64;
  c.admission = hicache::Admission::kAlways;
  HostPrefixCache cache({{kv.data(), 64, kBlockBytes, kBlockBytes}}, hicache::Device{}, c, nullptr,
                        tier);
  const auto prompt = tokens(64 * kB + 1, 300);
  ASSERT_EQ(cache.store("a", prompt, ids(0, 64)), 64);
  ASSERT_TRUE(cache.flush_tier());
  EXPECT_EQ(cache.stats().tier_pages_written, 64);
  EXPECT_EQ(tier->put_sizes, std::vector<std::size_t>{64});
}

TEST(Tier, AGetOfPagesTheTierThreadChecksEndsWithASmallEdgeRound) {
  // A buffer of 16 pages. A cache that loads layer by layer has the tier thread check a get's
  // pages as they arrive, in rounds of half the buffer: a 12-page get ends with a round of 1
  // page (8 / kEdgeShare) after the rest (6 + 5 + 1), so that little of the check waits beside
  // no transfer. The controls: caches whose loads check fetched pages, with the copier summing
  // them as it copies (segments of 1 KiB) or the load summing them beside the copy (a segment of
  // 1000 bytes: the checksum's blocks are 1 KiB), get in rounds of the whole buffer (12). Where
  // the copier cannot sum, the tier thread sums a put's pages; a put goes in rounds of the whole
  // buffer all the same (one batch, 12: a batch costs the client more than the sum a small
  // first round overlapped).
  for (const char* what : {"layer-wise", "segments of 1 KiB", "a segment of 1000 bytes"}) {
    SCOPED_TRACE(what);
    const bool layerwise = std::string(what) == "layer-wise";
    const bool summable = std::string(what) == "segments of 1 KiB";
    const std::int64_t first = summable || layerwise ? 1024 : 1000, page = 2048;
    auto tier = std::make_shared<CountingTier>();
    std::vector<std::uint8_t> kv(16 * page), kv_b(16 * page, 0);
    for (std::size_t i = 0; i < kv.size(); ++i) kv[i] = static_cast<std::uint8_t>(i * 7 + 3);
    auto segments = [&](std::vector<std::uint8_t>& v) {
      return std::vector<hicache::Segment>{{v.data(), 16, page, first},
                                           {v.data() + first, 16, page, page - first}};
    };
    CacheConfig c;
    c.block_tokens = kB;
    c.capacity_pages = 16;
    c.admission = hicache::Admission::kAlways;
    c.tier.buffer_bytes = 2 * 8 * page;
    HostPrefixCache a(segments(kv), hicache::Device{}, c, nullptr, tier);
    const auto prompt = tokens(12 * kB + 1, 500);
    ASSERT_EQ(a.store("a", prompt, ids(0, 12)), 12);
    ASSERT_TRUE(a.flush_tier());
    EXPECT_EQ(a.stats().tier_pages_written, 12);
    EXPECT_EQ(tier->put_sizes, std::vector<std::size_t>{12});
    if (layerwise) c.layer_segments = {2};
    HostPrefixCache b(segments(kv_b), hicache::Device{}, c, nullptr, tier);
    EXPECT_EQ(b.try_resume("b", prompt,
                           [](std::int64_t n) {
                             return std::optional<std::vector<std::int64_t>>(ids(0, n / kB));
                           }),
              12 * kB);
    const std::vector<std::size_t> gets =
        layerwise ? std::vector<std::size_t>{6, 5, 1} : std::vector<std::size_t>{12};
    EXPECT_EQ(tier->get_sizes, gets);
    EXPECT_TRUE(std::equal(kv_b.begin(), kv_b.begin() + 12 * page, kv.begin()));
  }
}
