// The hash chain against vectors produced by Python's hashlib.blake2b (the oracle).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <span>
#include <string>
#include <vector>

#include "blake2b.hpp"
#include "chain_hasher.hpp"
#include "hicache/hash_chain.hpp"

namespace {

std::string hex(const std::uint8_t* p, std::size_t n) {
  static const char* d = "0123456789abcdef";
  std::string s;
  for (std::size_t i = 0; i < n; ++i) {
    s += d[p[i] >> 4];
    s += d[p[i] & 15];
  }
  return s;
}

std::vector<std::int32_t> iota_tokens(int n) {
  std::vector<std::int32_t> t(static_cast<std::size_t>(n));
  std::iota(t.begin(), t.end(), 0);
  return t;
}

// The chain one page at a time (chain_first, chain_next): what every faster path must equal.
std::vector<hicache::Key> page_by_page(const std::string& salt, std::span<const std::int32_t> t,
                                       std::size_t pages) {
  std::vector<hicache::Key> keys;
  for (std::size_t i = 0; i < pages && (i + 1) * 128 <= t.size(); ++i) {
    const auto page = t.subspan(i * 128, 128);
    keys.push_back(i == 0 ? hicache::chain_first(salt, page)
                          : hicache::chain_next(keys.back(), page));
  }
  return keys;
}

}  // namespace

TEST(Blake2b, Rfc7693AbcVector) {
  hicache::detail::Blake2b h(64);
  h.update("abc", 3);
  std::uint8_t out[64];
  h.finish(out);
  EXPECT_EQ(hex(out, 64),
            "ba80a53f981c4d0d6a2797b69f12f6e94c212f14685ac4b74b12bb6fdbffa2d17d87c5392aab792dc252d5"
            "de4533cc9518d38aa8dbf1925ab92386edd4009923");
}

TEST(Blake2b, EmptyInputWith16ByteDigest) {
  hicache::detail::Blake2b h(16);
  std::uint8_t out[16];
  h.finish(out);
  EXPECT_EQ(hex(out, 16), "cae66941d9efbd404e4d88758ea67670");
}

TEST(Blake2b, MultiBlockInputFedInOddPiecesMatchesHashlib) {
  std::vector<std::uint8_t> data;
  for (int r = 0; r < 3; ++r)
    for (int i = 0; i < 256; ++i) data.push_back(static_cast<std::uint8_t>(i));
  hicache::detail::Blake2b h(16);
  std::size_t off = 0;
  for (std::size_t piece : {1u, 127u, 128u, 129u, 300u}) {
    h.update(data.data() + off, piece);
    off += piece;
  }
  h.update(data.data() + off, data.size() - off);
  std::uint8_t out[16];
  h.finish(out);
  EXPECT_EQ(hex(out, 16), "e0892860f9fc0da273b9db57e857c19a");
}

TEST(Blake2b, AStateMadeOfWholeBlocksFinishesAsOneUpdateWould) {
  std::vector<std::uint8_t> data(256 + 16);
  for (std::size_t i = 0; i < data.size(); ++i) data[i] = static_cast<std::uint8_t>(i * 7);
  hicache::detail::Blake2b whole(16);
  whole.update(data.data(), data.size());
  std::uint8_t expect[16];
  whole.finish(expect);
  hicache::detail::Blake2b mid(16);
  mid.update(data.data(), 256);
  mid.more_follows();  // compresses the second block now; the copy finishes with the rest
  hicache::detail::Blake2b copy = mid;
  copy.update(data.data() + 256, 16);
  std::uint8_t got[16];
  copy.finish(got);
  EXPECT_EQ(hex(got, 16), hex(expect, 16));
}

// update4 compresses four messages side by side; every lane must end as that message hashed
// alone would, whatever the length (whole blocks, a tail, nothing) and the suffix after it, with
// every four-lane kernel this CPU runs (the widest is the one in use, the others are its
// fallbacks on other CPUs).
TEST(Blake2b, FourMessagesAtOnceEndAsEachHashedAlone) {
  using hicache::detail::Blake2b;
  const std::vector<std::string> kernels = hicache::detail::four_lane_kernels();
  ASSERT_FALSE(kernels.empty());
  EXPECT_EQ(kernels.front(), "baseline");
  const std::string in_use = hicache::detail::use_four_lane_kernel(kernels.back());
  EXPECT_EQ(in_use, kernels.back());  // the widest one was chosen
  EXPECT_THROW(hicache::detail::use_four_lane_kernel("no-such-kernel"), std::invalid_argument);
  std::vector<std::uint8_t> data(4 * 1100);
  for (std::size_t i = 0; i < data.size(); ++i) data[i] = static_cast<std::uint8_t>(i * 131 + 7);
  for (const std::string& kernel : kernels) {
    SCOPED_TRACE("kernel " + kernel);
    hicache::detail::use_four_lane_kernel(kernel);
    for (std::size_t n : {0u, 1u, 127u, 128u, 129u, 256u, 300u, 512u, 1100u}) {
      std::vector<Blake2b> four(4, Blake2b(16)), alone(4, Blake2b(16));
      Blake2b* const states[4] = {&four[0], &four[1], &four[2], &four[3]};
      const std::uint8_t* msgs[4];
      for (int l = 0; l < 4; ++l) msgs[l] = data.data() + 1100 * static_cast<std::size_t>(l);
      Blake2b::update4(states, msgs, n);
      for (int l = 0; l < 4; ++l) {
        alone[static_cast<std::size_t>(l)].update(msgs[l], n);
        alone[static_cast<std::size_t>(l)].more_follows();
      }
      for (std::size_t l = 0; l < 4; ++l) {
        const std::uint8_t suffix[16] = {static_cast<std::uint8_t>(l), 1, 2, 3};
        std::uint8_t got[16], expect[16];
        four[l].update(suffix, sizeof suffix);
        four[l].finish(got);
        alone[l].update(suffix, sizeof suffix);
        alone[l].finish(expect);
        EXPECT_EQ(hex(got, 16), hex(expect, 16)) << "lane " << l << ", " << n << " bytes";
      }
    }
  }
  hicache::detail::use_four_lane_kernel(in_use);
}

// A lane that already holds part of a block cannot share the vector: update4 hashes the four one
// at a time and still ends as each alone would.
TEST(Blake2b, FourMessagesOneOfThemMidBlockEndAsEachHashedAlone) {
  using hicache::detail::Blake2b;
  std::vector<std::uint8_t> data(1024);
  for (std::size_t i = 0; i < data.size(); ++i) data[i] = static_cast<std::uint8_t>(i * 13);
  std::vector<Blake2b> four(4, Blake2b(16)), alone(4, Blake2b(16));
  four[2].update(data.data(), 5);
  alone[2].update(data.data(), 5);
  Blake2b* const states[4] = {&four[0], &four[1], &four[2], &four[3]};
  const std::uint8_t* msgs[4] = {data.data(), data.data() + 100, data.data() + 200,
                                 data.data() + 300};
  Blake2b::update4(states, msgs, 512);
  for (std::size_t l = 0; l < 4; ++l) {
    alone[l].update(msgs[l], 512);
    alone[l].more_follows();
    std::uint8_t got[16], expect[16];
    four[l].finish(got);
    alone[l].finish(expect);
    EXPECT_EQ(hex(got, 16), hex(expect, 16)) << "lane " << l;
  }
}

// Chains of every length around the four-page groups (one page at a time on the calling thread
// before: now four at a time), with and without a salt, token blocks of whole BLAKE2b blocks and
// of ragged lengths: the keys chain_step gives page by page.
TEST(HashChain, PagesHashedFourAtATimeGiveThePageByPageChain) {
  for (std::int64_t block : {1, 3, 32, 100, 128, 257}) {
    for (const std::string salt : {"", "tenant-7"}) {
      for (int pages = 0; pages <= 11; ++pages) {
        std::vector<std::int32_t> t(
            static_cast<std::size_t>((pages + 1) * block - 1));  // a partial page after
        for (std::size_t i = 0; i < t.size(); ++i)
          t[i] = static_cast<std::int32_t>(i * 2654435761u);
        std::vector<hicache::Key> expect;
        for (int i = 0; i < pages; ++i) {
          const auto page = std::span<const std::int32_t>(t).subspan(
              static_cast<std::size_t>(i * block), static_cast<std::size_t>(block));
          expect.push_back(i == 0 ? hicache::chain_first(salt, page)
                                  : hicache::chain_next(expect.back(), page));
        }
        EXPECT_EQ(hicache::chain_keys(salt, t, block, 1 << 20, 128), expect)
            << "block " << block << ", salt '" << salt << "', " << pages << " pages";
      }
    }
  }
}

TEST(HashChain, FirstKeyAndNextKeyMatchHashlib) {
  const auto t0 = iota_tokens(128);
  const hicache::Key k0 = hicache::chain_first("", t0);
  EXPECT_EQ(k0.hex(), "ae60e591e6dd21c3cb937e62770392c9");
  std::vector<std::int32_t> t1;
  for (int i = 0; i < 43; ++i) {
    t1.push_back(-5);
    t1.push_back(2147483647);
    t1.push_back(7);
  }
  t1.resize(128);
  EXPECT_EQ(hicache::chain_next(k0, t1).hex(), "3cec13bfedfbf98f5fdf7cb02ed8c1bf");
}

TEST(HashChain, SaltIsTheRoot) {
  const auto t0 = iota_tokens(128);
  EXPECT_EQ(hicache::chain_first("tenant-a", t0).hex(), "85424fe689ce127c03cf16d51de68ceb");
  EXPECT_NE(hicache::chain_first("tenant-a", t0), hicache::chain_first("tenant-b", t0));
}

TEST(HashChain, ChainKeysCoverOnlyFullPagesUpToTheCap) {
  const auto t = iota_tokens(128 * 3 + 5);
  EXPECT_EQ(hicache::chain_keys("", t, 128).size(), 3u);
  EXPECT_EQ(hicache::chain_keys("", t, 128, 2).size(), 2u);
  EXPECT_EQ(hicache::chain_keys("", t, 128, 0).size(), 0u);
  const auto keys = hicache::chain_keys("", t, 128);
  EXPECT_EQ(keys[0].hex(), "ae60e591e6dd21c3cb937e62770392c9");
  EXPECT_EQ(keys[1], hicache::chain_next(keys[0], std::span(t).subspan(128, 128)));
  EXPECT_THROW(hicache::chain_keys("", t, 0), std::invalid_argument);
}

// Long prompts hash their pages' token blocks on several threads, in runs of at most 2048 pages,
// and finish the chain on the calling thread: the keys must be those of the page-by-page chain,
// with and without a salt, truncated or not, whole or in installments.
TEST(HashChain, LongPromptsHashedOnSeveralThreadsGiveThePageByPageChain) {
  const int pages = 5000;
  const auto t = iota_tokens(128 * pages + 77);
  for (const std::string salt : {"", "tenant-a"}) {
    for (int bits : {128, 20}) {
      std::vector<hicache::Key> expect;
      for (int i = 0; i < pages; ++i) {
        const auto page = std::span(t).subspan(static_cast<std::size_t>(i) * 128, 128);
        hicache::Key k =
            i == 0 ? hicache::chain_first(salt, page) : hicache::chain_next(expect.back(), page);
        for (int b = 0; b < 16; ++b) {
          const int keep = std::clamp(bits - 8 * b, 0, 8);
          k.bytes[static_cast<std::size_t>(b)] &= static_cast<std::uint8_t>(0xFF00 >> keep);
        }
        expect.push_back(k);
      }
      EXPECT_EQ(hicache::chain_keys(salt, t, 128, INT64_MAX, bits), expect) << salt << bits;
      std::vector<hicache::Key> parts;
      for (std::int64_t upto : {16, 700, 2100, 4999, 5000}) {
        hicache::extend_chain_keys(parts, salt, t, 128, upto, bits);
        ASSERT_EQ(parts.size(), static_cast<std::size_t>(upto));
      }
      EXPECT_EQ(parts, expect) << salt << bits;
    }
  }
}

// Installments (16, 32, 64... pages, each one's token blocks hashed ahead on the page threads once
// they are enough bytes) give the page-by-page chain, up to the limit; so does a hasher that
// starts from keys it did not compute (a lookup's cached pages, whose keys are their entries').
TEST(HashChain, InstallmentsOfALookupGiveTheSameKeys) {
  const auto t = iota_tokens(128 * 9000 + 5);  // past one run of midstates (8192 pages)
  for (const std::string salt : {"", "s"}) {
    for (std::int64_t limit : {10, 3000, 9000, 20000}) {
      const auto expect = page_by_page(salt, t, static_cast<std::size_t>(limit));
      hicache::detail::ChainHasher hasher(salt, t, 128, limit, 128);
      std::vector<hicache::Key> keys;
      for (std::int64_t upto = 16; keys.size() < expect.size(); upto *= 2) {
        hasher.extend(keys, upto);
        ASSERT_EQ(keys.size(),
                  std::min<std::size_t>(static_cast<std::size_t>(upto), expect.size()));
      }
      hasher.extend(keys, limit + 5);  // nothing past the limit
      EXPECT_EQ(keys, expect) << salt << " " << limit;
      const std::size_t given = std::min<std::size_t>(1000, expect.size());
      std::vector<hicache::Key> rest(expect.begin(), expect.begin() + static_cast<long>(given));
      hicache::detail::ChainHasher(salt, t, 128, limit, 128).extend(rest, limit);
      EXPECT_EQ(rest, expect) << salt << " " << limit << " from " << given;
    }
  }
}

// A store's chain hashed on the background thread (ChainAhead) gives the page-by-page keys
// however the store asks for them (a few more at a time, everything at once, the keys it has
// when it asks), with or without a salt and truncated keys; where the background thread is taken
// (a second store at the same time) it hashes on the caller's thread, to the same keys.
TEST(HashChain, KeysHashedAheadOnTheBackgroundThreadAreTheChainsKeys) {
  const auto t = iota_tokens(16 * 3000 + 7);
  for (const std::string salt : {"", "s"}) {
    for (int bits : {128, 12}) {
      const auto expect = hicache::chain_keys(salt, t, 16, 3000, bits);
      for (std::int64_t step : {1, 16, 700, 3000}) {
        hicache::detail::ChainHasher hasher(salt, t, 16, 3000, bits);
        std::vector<hicache::Key> keys;
        hasher.extend(keys, 16);
        hicache::detail::ChainAhead ahead(hasher, keys);
        EXPECT_TRUE(ahead.started());  // the background thread was free
        // A second chain while the first one has the background thread: on this thread.
        hicache::detail::ChainHasher other(salt, t, 16, 3000, bits);
        std::vector<hicache::Key> other_keys;
        other.extend(other_keys, 16);
        hicache::detail::ChainAhead second(other, other_keys);
        second.extend(other_keys, 3000, 3000);
        EXPECT_EQ(other_keys, expect) << salt << bits;
        while (keys.size() < expect.size()) {
          const std::size_t had = keys.size();
          ahead.extend(keys, static_cast<std::int64_t>(had) + step,
                       static_cast<std::int64_t>(had) + step);
          ASSERT_GE(keys.size(), std::min(expect.size(), had + static_cast<std::size_t>(step)));
        }
        ahead.extend(keys, 3005, 3005);  // nothing past the limit
        EXPECT_EQ(keys, expect) << salt << " " << bits << " " << step;
      }
    }
  }
  // From no keys at all (a chain the caller has not begun).
  {
    const auto expect = hicache::chain_keys("", t, 16, 3000);
    hicache::detail::ChainHasher hasher("", t, 16, 3000, 128);
    std::vector<hicache::Key> keys;
    hicache::detail::ChainAhead ahead(hasher, keys);
    EXPECT_TRUE(ahead.started());
    ahead.extend(keys, 3000, 3000);
    EXPECT_EQ(keys, expect);
  }
  // A short chain is not worth the hand-over: hashed here, as before.
  const auto short_expect = hicache::chain_keys("", t, 16, 40);
  hicache::detail::ChainHasher hasher("", t, 16, 40, 128);
  std::vector<hicache::Key> keys;
  hasher.extend(keys, 16);
  hicache::detail::ChainAhead ahead(hasher, keys);
  EXPECT_FALSE(ahead.started());
  ahead.extend(keys, 20, 32);
  EXPECT_EQ(keys.size(), 32u);  // not running: ChainHasher::extend up to `upto`
  ahead.extend(keys, 40, 40);
  EXPECT_EQ(keys, short_expect);
}

TEST(HashChain, TruncatedKeysKeepTheLeadingBitsAndSeedTheNextKey) {
  const auto t = iota_tokens(256);
  const auto weak = hicache::chain_keys("", t, 128, INT64_MAX, 12);
  const auto full0 = hicache::chain_first("", std::span(t).first(128));
  EXPECT_EQ(weak[0].bytes[0], full0.bytes[0]);
  EXPECT_EQ(weak[0].bytes[1], full0.bytes[1] & 0xF0);
  for (int i = 2; i < 16; ++i) EXPECT_EQ(weak[0].bytes[static_cast<std::size_t>(i)], 0);
  hicache::Key next = hicache::chain_next(weak[0], std::span(t).subspan(128, 128));
  next.bytes[1] &= 0xF0;
  for (int i = 2; i < 16; ++i) next.bytes[static_cast<std::size_t>(i)] = 0;
  EXPECT_EQ(weak[1], next);
  EXPECT_THROW(hicache::chain_keys("", t, 128, INT64_MAX, 0), std::invalid_argument);
  EXPECT_THROW(hicache::chain_keys("", t, 128, INT64_MAX, 129), std::invalid_argument);
}

TEST(HashChain, ExtendingInInstallmentsGivesTheSameKeys) {
  const auto t = iota_tokens(10 * 16 + 5);
  for (int bits : {3, 128}) {
    const auto whole = hicache::chain_keys("salt", t, 16, INT64_MAX, bits);
    ASSERT_EQ(whole.size(), 10u);
    std::vector<hicache::Key> keys;
    for (std::int64_t upto : {0, 1, 3, 3, 7, 12}) {
      hicache::extend_chain_keys(keys, "salt", t, 16, upto, bits);
      ASSERT_EQ(keys.size(), static_cast<std::size_t>(std::min<std::int64_t>(upto, 10)));
      for (std::size_t i = 0; i < keys.size(); ++i) EXPECT_EQ(keys[i], whole[i]) << i;
    }
  }
}
