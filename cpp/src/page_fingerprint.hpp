#pragma once
// page_fingerprint: the 64-bit fingerprint of a page's tokens that the index files a page's
// content edge under (PrefixIndex::add_edge), so that a walk along a prompt finds cached pages
// without hashing their chain keys. A lookup takes one per page it walks and a store one per
// page it adds.
//
// It never leaves the process and never decides a hit on its own: callers compare the parent
// and the tokens of the entry an edge names, and an edge that two pages' fingerprints share is
// held by one of them (the other is found by its key). So it needs to spread pages well, not to
// resist anyone. The page checksum it replaced (page_checksum.hpp, which must run at memory speed
// over megabytes and fold eight lanes at the end) cost about 40 ns for 16 tokens and 80 for 128
// on this project's 2-core machine, over a third of a lookup's CPU; this takes four independent
// chains of 64x64 -> 128-bit multiplies folded hi ^ lo (as wyhash's mixing does) over 16 bytes
// each, and folds the four at the end.

#include <cstdint>
#include <cstring>
#include <span>

namespace hicache::detail {

namespace fingerprint_detail {

inline std::uint64_t fold_mul(std::uint64_t a, std::uint64_t b) {
  const unsigned __int128 r = static_cast<unsigned __int128>(a) * b;
  return static_cast<std::uint64_t>(r) ^ static_cast<std::uint64_t>(r >> 64);
}

inline std::uint64_t load64(const unsigned char* p) {
  std::uint64_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// Odd constants with about half their bits set (from the digits of pi and e).
inline constexpr std::uint64_t kLane[8] = {
    0x243F6A8885A308D3ULL, 0x13198A2E03707345ULL, 0xA4093822299F31D1ULL, 0x082EFA98EC4E6C89ULL,
    0x452821E638D01377ULL, 0xBE5466CF34E90C6DULL, 0xC0AC29B7C97C50DDULL, 0x3F84D5B5B5470917ULL};

}  // namespace fingerprint_detail

inline std::uint64_t page_fingerprint(std::span<const std::int32_t> tokens) {
  using namespace fingerprint_detail;
  const auto* p = reinterpret_cast<const unsigned char*>(tokens.data());
  std::size_t n = tokens.size_bytes();
  std::uint64_t h[4] = {kLane[0] ^ n, kLane[1], kLane[2], kLane[3]};
  for (; n >= 64; n -= 64, p += 64) {  // four chains side by side: their multiplies overlap
    h[0] = fold_mul(load64(p) ^ kLane[4] ^ h[0], load64(p + 8) ^ kLane[0]);
    h[1] = fold_mul(load64(p + 16) ^ kLane[5] ^ h[1], load64(p + 24) ^ kLane[1]);
    h[2] = fold_mul(load64(p + 32) ^ kLane[6] ^ h[2], load64(p + 40) ^ kLane[2]);
    h[3] = fold_mul(load64(p + 48) ^ kLane[7] ^ h[3], load64(p + 56) ^ kLane[3]);
  }
  for (std::size_t l = 0; n >= 8; ++l, n -= 8, p += 8) {  // the words after the last 64 bytes
    h[l % 4] = fold_mul(load64(p) ^ kLane[4 + l % 4] ^ h[l % 4], kLane[l % 4] + l);
  }
  if (n > 0) {  // a last token (tokens are 4 bytes)
    std::uint32_t last;
    std::memcpy(&last, p, sizeof last);
    h[0] = fold_mul(last ^ kLane[4] ^ h[0], kLane[5]);
  }
  return fold_mul(h[0] ^ kLane[6], h[1] ^ kLane[7]) ^ fold_mul(h[2] ^ kLane[5], h[3] ^ kLane[4]);
}

}  // namespace hicache::detail
