#pragma once
// The checksum a tier record carries of its page (tier_record.hpp), and the same pass copying
// the page on the way (the CPU copier's, when a cache with a tier asks it to sum pages).
// Internal: tier_record.cpp and cpu_copier.cpp use it.
//
// Not cryptographic: it catches torn, truncated and overwritten pages (the keys and tokens in
// the record are what make a page exact). It must run at memory speed, since every page a cache
// puts to or fetches from its tier goes through it once: eight 64-bit lanes per 64-byte stripe,
// each adding its word and the product of the word's halves (mixed with a per-stripe constant),
// scrambled every kilobyte (XXH3's accumulate and scramble steps). On this project's 2-core CI
// machine the AVX2 form sums 64 MiB in 1.9-2.2 ms (the core's read bandwidth) where the portable
// form, like the multiply-rotate checksum before it, takes 3.8-4.2 ms; both forms give the same
// value on every machine.

#include <cstddef>
#include <cstdint>
#include <span>

namespace hicache::detail {

/// The checksum of `bytes`, copying them to `out` on the way when it is not null.
std::uint64_t checksum_copy(std::span<const std::byte> bytes, std::byte* out);

/// The same checksum of a page that arrives in pieces (a layer-major page's segments), copying
/// each piece on the way as checksum_copy does. Every piece but the last must be whole kilobytes
/// (the checksum's blocks); add() returns false, copying nothing, for a piece after one that was
/// not (the caller then sums the page once it is whole). The last piece must stay readable until
/// value().
class ChecksumCopy {
 public:
  static constexpr std::size_t kBlock = 1024;
  ChecksumCopy();
  bool add(std::span<const std::byte> bytes, std::byte* out);
  std::uint64_t value();

 private:
  std::uint64_t acc_[8];
  std::size_t total_ = 0;
  std::span<const std::byte> tail_;
};

/// The portable form (tests compare it with whichever form checksum_copy uses here).
std::uint64_t checksum_copy_portable(std::span<const std::byte> bytes, std::byte* out);

}  // namespace hicache::detail
