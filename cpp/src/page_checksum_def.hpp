#pragma once
// The page checksum's definition, step by step (internal): one source for the CPU's forms
// (page_checksum.cpp) and the GPU's (cpp/cuda/device_sums.cu), so that a page summed on the
// device as a store copies it reads the same value as the CPU's sum of its host bytes.
//
// A page is cut into 1 KiB blocks of sixteen 64-byte stripes. Lane i (0-7) of stripe s adds
// word i of the stripe and the product of the halves of that word mixed with secret(s + i); each
// whole block ends with a scramble of every lane. The stripes after the last whole block take no
// scramble; the lanes are then folded into one value with the page's length, and the bytes
// after the last stripe are mixed in one at a time.

#include <cstddef>
#include <cstdint>

#if defined(__CUDACC__)
#define HICACHE_HOST_DEVICE __host__ __device__
#else
#define HICACHE_HOST_DEVICE
#endif

namespace hicache::detail::checksum_def {

using u64 = std::uint64_t;

inline constexpr int kLanes = 8;     // 64-bit lanes of a stripe
inline constexpr int kStripes = 16;  // stripes of a block, between two scrambles
inline constexpr std::size_t kStripe = 64;
inline constexpr std::size_t kBlock = kStripe * kStripes;
inline constexpr u64 kScramble = 0x9E3779B1ULL;
inline constexpr u64 kP1 = 0x9E3779B185EBCA87ULL, kP2 = 0xC2B2AE3D27D4EB4FULL;

HICACHE_HOST_DEVICE constexpr u64 mix(u64 z) {  // splitmix64's finalizer
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

/// Secret j: stripe s's lane i mixes its word with secret(s + i), the scramble of lane i uses
/// secret(kStripes + i), and lane i starts at secret(i).
HICACHE_HOST_DEVICE constexpr u64 secret(int j) {
  return mix(0x9E3779B97F4A7C15ULL * static_cast<u64>(j + 1));
}

/// One lane of one stripe: its word `w` added to the lane's accumulator, mixed with `k`.
HICACHE_HOST_DEVICE constexpr u64 accumulate(u64 acc, u64 w, u64 k) {
  const u64 x = w ^ k;
  return acc + w + (x & 0xFFFFFFFFULL) * (x >> 32);
}

/// One lane at the end of a whole block (`k`: secret(kStripes + lane)).
HICACHE_HOST_DEVICE constexpr u64 scramble(u64 a, u64 k) {
  a ^= a >> 47;
  a ^= k;
  return a * kScramble;
}

/// The lanes folded into one value, with the page's length in bytes.
HICACHE_HOST_DEVICE constexpr u64 fold(const u64* acc, u64 total) {
  u64 h = total;
  for (int i = 0; i < kLanes; ++i) h = (h ^ mix(acc[i])) * kP1;
  return h;
}

/// One byte after the last whole stripe, mixed into the folded value.
HICACHE_HOST_DEVICE constexpr u64 tail_byte(u64 h, std::uint8_t b) {
  h = (h ^ static_cast<u64>(b)) * kP2;
  return h ^ (h >> 29);
}

/// The checksum, once every byte was mixed in.
HICACHE_HOST_DEVICE constexpr u64 finish(u64 h) { return mix(h); }

}  // namespace hicache::detail::checksum_def
