#include "hicache/tier_record.hpp"

#include <array>
#include <cstring>
#include <stdexcept>
#include <vector>

#include "hicache/hash_chain.hpp"
#include "page_checksum.hpp"

namespace hicache {
namespace {

// "hicache4": the record after the page ("hicache3" put it before; "hicache2" had a slower
// checksum; "hicache1" hashed the previous key before a page's tokens).
constexpr std::array<char, 8> kMagic = {'h', 'i', 'c', 'a', 'c', 'h', 'e', '4'};
constexpr std::size_t kHeader = 8 + 16 * 3 + 4 + 4 + 8 + 8;
// The record is zero-padded to a multiple of this (a cache line).
constexpr std::size_t kRecordAlign = 64;

std::size_t record_bytes(std::size_t tokens) {
  return (kHeader + tokens * sizeof(std::int32_t) + kRecordAlign - 1) / kRecordAlign * kRecordAlign;
}

template <class T>
void put(std::byte*& p, const T& v) {
  std::memcpy(p, &v, sizeof v);
  p += sizeof v;
}

template <class T>
T take(const std::byte*& p) {
  T v;
  std::memcpy(&v, p, sizeof v);
  p += sizeof v;
  return v;
}

}  // namespace

Key tier_space(std::string_view space, const PageLayout& layout, std::int64_t block_tokens,
               int key_bits) {
  std::vector<std::uint8_t> d(space.begin(), space.end());
  auto add = [&](std::int64_t v) {
    const auto* b = reinterpret_cast<const std::uint8_t*>(&v);
    d.insert(d.end(), b, b + sizeof v);
  };
  add(block_tokens);
  add(key_bits);
  add(static_cast<std::int64_t>(layout.segments().size()));
  for (const Segment& s : layout.segments()) add(s.block_bytes);
  return chain_step({}, d);
}

Key tier_salt_digest(std::string_view salt) {
  return chain_step({}, {reinterpret_cast<const std::uint8_t*>(salt.data()), salt.size()});
}

std::string tier_value_name(const Key& space, const Key& key) {
  return "hicache/" + space.hex() + "/" + key.hex();
}

std::size_t tier_record_bytes(std::int64_t block_tokens) {
  return record_bytes(static_cast<std::size_t>(block_tokens));
}

std::size_t tier_value_bytes(std::int64_t block_tokens, std::size_t page_bytes) {
  return page_bytes + tier_record_bytes(block_tokens);
}

std::uint64_t page_checksum(std::span<const std::byte> bytes) {
  return detail::checksum_copy(bytes, nullptr);
}

void write_tier_record(std::byte* out, const Key& space, const Key& key, const Key& parent,
                       std::span<const std::int32_t> tokens, std::size_t page_bytes,
                       std::uint64_t checksum) {
  std::byte* p = out;
  put(p, kMagic);
  put(p, space.bytes);
  put(p, key.bytes);
  put(p, parent.bytes);
  put(p, static_cast<std::uint32_t>(tokens.size()));
  put(p, std::uint32_t{0});
  put(p, static_cast<std::uint64_t>(page_bytes));
  put(p, checksum);
  // A record of no tokens (PageStore's: the engine's key stands for them) has no data pointer.
  if (!tokens.empty()) std::memcpy(p, tokens.data(), tokens.size_bytes());
  p += tokens.size_bytes();
  std::memset(p, 0, record_bytes(tokens.size()) - static_cast<std::size_t>(p - out));
}

void encode_tier_value(std::byte* out, const Key& space, const Key& key, const Key& parent,
                       std::span<const std::int32_t> tokens, std::span<const std::byte> page) {
  const std::uint64_t checksum = detail::checksum_copy(page, out);  // copies the page as it sums
  write_tier_record(out + page.size(), space, key, parent, tokens, page.size(), checksum);
}

Key tier_record_parent(std::span<const std::byte> value, std::size_t page_bytes) {
  Key k;
  // magic (8), space (16), page key (16), then the parent.
  std::memcpy(k.bytes.data(), value.data() + page_bytes + 8 + 16 + 16, k.bytes.size());
  return k;
}

TierPage check_tier_record(std::span<const std::byte> value, const Key& space, const Key& key,
                           const Key& parent, std::span<const std::int32_t> tokens,
                           std::size_t page_bytes, std::string& why) {
  const std::size_t want = page_bytes + record_bytes(tokens.size());
  if (value.size() != want) {
    why = "value of " + std::to_string(value.size()) + " bytes, not " + std::to_string(want) +
          " (truncated, or another layout's)";
    return {};
  }
  const std::byte* p = value.data() + page_bytes;
  if (take<std::array<char, 8>>(p) != kMagic) {
    why = "not a hicache record";
    return {};
  }
  if (take<std::array<std::uint8_t, 16>>(p) != space.bytes) {
    why = "another space (model, version or layout)";
    return {};
  }
  if (take<std::array<std::uint8_t, 16>>(p) != key.bytes) {
    why = "another page's record";
    return {};
  }
  if (take<std::array<std::uint8_t, 16>>(p) != parent.bytes) {
    why = "another prefix or salt (parent key differs)";
    return {};
  }
  const auto n_tokens = take<std::uint32_t>(p);
  (void)take<std::uint32_t>(p);
  const auto n_page = take<std::uint64_t>(p);
  const auto checksum = take<std::uint64_t>(p);
  if (n_tokens != tokens.size() || n_page != page_bytes) {
    why = "another page size";
    return {};
  }
  if (!tokens.empty() && std::memcmp(p, tokens.data(), tokens.size_bytes()) != 0) {
    why = "other tokens (a key collision)";
    return {};
  }
  p += tokens.size_bytes();
  for (const std::byte* end = value.data() + value.size(); p < end; ++p) {
    if (*p != std::byte{0}) {
      why = "not a hicache record (padding)";
      return {};
    }
  }
  return {value.first(page_bytes), checksum};
}

namespace {
constexpr const char* kTorn = "page bytes do not match their checksum (overwritten or torn)";
}  // namespace

std::span<const std::byte> check_tier_value(std::span<const std::byte> value, const Key& space,
                                            const Key& key, const Key& parent,
                                            std::span<const std::int32_t> tokens,
                                            std::size_t page_bytes, std::string& why) {
  const TierPage page = check_tier_record(value, space, key, parent, tokens, page_bytes, why);
  if (page.bytes.empty()) return {};
  if (page_checksum(page.bytes) != page.checksum) {
    why = kTorn;
    return {};
  }
  return page.bytes;
}

}  // namespace hicache
