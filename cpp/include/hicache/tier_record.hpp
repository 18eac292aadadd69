#pragma once
// The value hicache writes to a tier for one page: the page's bytes, followed by a record that
// lets any reader, on any host, check the page as exactly as a host page.
//
//   page | magic "hicache4" | space key (16) | page key (16) | parent key (16) | tokens (u32) |
//   reserved (u32) | page bytes (u64) | page checksum (u64) | tokens as int32 |
//   zeros to a multiple of 64 bytes
//
// The record comes last so that a value can be put straight from a host slot: a cache with a
// tier gives each slot room for its page's record after the page, and writes the record there.
//
// The parent key of page 0 is the salt's digest, so tenants stay apart across hosts too. A
// value is accepted only if every field matches what the reader computed from its own prompt,
// salt and layout and the page's checksum holds: a missing, stale, truncated, foreign (another
// model, version or layout) or overwritten value is a miss, never served.

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>

#include "hicache/key.hpp"
#include "hicache/page_layout.hpp"

namespace hicache {

/// Names a model's pages in a shared tier: the space the engine chose (TierOptions::space) and
/// what makes its pages incompatible with others' (the page layout, tokens a page, key bits).
Key tier_space(std::string_view space, const PageLayout& layout, std::int64_t block_tokens,
               int key_bits);

/// The parent key recorded for page 0 under `salt`.
Key tier_salt_digest(std::string_view salt);

/// The value's name in the tier: "hicache/<space>/<key>" in hex.
std::string tier_value_name(const Key& space, const Key& key);

/// Bytes of the record for a page of `block_tokens` tokens.
std::size_t tier_record_bytes(std::int64_t block_tokens);

/// Bytes of one value: the page and its record.
std::size_t tier_value_bytes(std::int64_t block_tokens, std::size_t page_bytes);

/// Writes the record of a page of `page_bytes` whose checksum (page_checksum) is `checksum` to
/// `out` (tier_record_bytes(tokens.size()) bytes; right after the page, the value is whole).
void write_tier_record(std::byte* out, const Key& space, const Key& key, const Key& parent,
                       std::span<const std::int32_t> tokens, std::size_t page_bytes,
                       std::uint64_t checksum);

/// Writes a page's value (tier_value_bytes(tokens.size(), page.size()) bytes) to `out`: the
/// page, copied and summed in one pass, then its record.
void encode_tier_value(std::byte* out, const Key& space, const Key& key, const Key& parent,
                       std::span<const std::int32_t> tokens, std::span<const std::byte> page);

/// The parent key recorded in a value of a page of `page_bytes` (unchecked: check_tier_record
/// decides whether the value is one). `value` must hold at least the page and a record.
Key tier_record_parent(std::span<const std::byte> value, std::size_t page_bytes);

/// A page in a value whose record matched (check_tier_record), with the checksum its writer
/// recorded: not yet checked against its bytes.
struct TierPage {
  std::span<const std::byte> bytes;
  std::uint64_t checksum = 0;
};

/// The page in `value` if it is the value encode_tier_value wrote for exactly these fields;
/// otherwise empty bytes, with the reason in `why`. The page's own bytes are not checked yet:
/// the caller checks them against the checksum, where they landed or as it first copies them
/// (one pass over the page instead of two).
TierPage check_tier_record(std::span<const std::byte> value, const Key& space, const Key& key,
                           const Key& parent, std::span<const std::int32_t> tokens,
                           std::size_t page_bytes, std::string& why);

/// The page in `value` if it is the value encode_tier_value wrote for exactly these fields and
/// its page is intact; otherwise an empty span, with the reason in `why`.
std::span<const std::byte> check_tier_value(std::span<const std::byte> value, const Key& space,
                                            const Key& key, const Key& parent,
                                            std::span<const std::int32_t> tokens,
                                            std::size_t page_bytes, std::string& why);

/// A fast 64-bit checksum of bytes (not cryptographic: it catches torn and overwritten pages;
/// the keys and tokens in the record are what make a page exact).
std::uint64_t page_checksum(std::span<const std::byte> bytes);

}  // namespace hicache
