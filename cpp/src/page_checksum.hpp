#pragma once
// The checksum a tier record carries of its page (tier_record.hpp), and the same pass copying
// the page on the way. Internal: tier_record.cpp is its only user.
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

/// The portable form (tests compare it with whichever form checksum_copy uses here).
std::uint64_t checksum_copy_portable(std::span<const std::byte> bytes, std::byte* out);

}  // namespace hicache::detail
