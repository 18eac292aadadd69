// The hash chain against vectors produced by Python's hashlib.blake2b (the oracle).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <string>
#include <vector>

#include "blake2b.hpp"
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
  EXPECT_EQ(hicache::chain_next(k0, t1).hex(), "9a787081d852ccc7736a2f874cebc71e");
}

TEST(HashChain, SaltIsTheRoot) {
  const auto t0 = iota_tokens(128);
  EXPECT_EQ(hicache::chain_first("tenant-a", t0).hex(), "924cf8f35707845095446dd0c2381db3");
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
