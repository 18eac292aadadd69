#include "hicache/tier_record.hpp"

#include <array>
#include <cstring>
#include <stdexcept>
#include <vector>

#include "hicache/hash_chain.hpp"

namespace hicache {
namespace {

// "hicache2": keys hash the tokens before the previous key ("hicache1" hashed it first).
constexpr std::array<char, 8> kMagic = {'h', 'i', 'c', 'a', 'c', 'h', 'e', '2'};
constexpr std::size_t kHeader = 8 + 16 * 3 + 4 + 4 + 8 + 8;

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

std::uint64_t rotl(std::uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }

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

std::size_t tier_value_bytes(std::int64_t block_tokens, std::size_t page_bytes) {
  return kHeader + static_cast<std::size_t>(block_tokens) * sizeof(std::int32_t) + page_bytes;
}

namespace {

// The checksum's core, copying the bytes to `out` on the way when it is not null (one pass over
// memory instead of two). Eight independent multiply-rotate lanes (xxHash's round) over 64-byte
// stripes keep enough in flight to run at memory speed.
std::uint64_t checksum_copy(std::span<const std::byte> bytes, std::byte* out) {
  constexpr std::uint64_t kP1 = 0x9E3779B185EBCA87ULL, kP2 = 0xC2B2AE3D27D4EB4FULL;
  std::uint64_t lane[8];
  for (int i = 0; i < 8; ++i) lane[i] = kP1 * static_cast<std::uint64_t>(i + 1);
  const std::byte* p = bytes.data();
  std::size_t n = bytes.size();
  for (; n >= 64; n -= 64, p += 64) {
    std::uint64_t w[8];
    std::memcpy(w, p, 64);
    for (int i = 0; i < 8; ++i) lane[i] = rotl(lane[i] + w[i] * kP2, 31) * kP1;
    if (out != nullptr) {
      std::memcpy(out, w, 64);
      out += 64;
    }
  }
  std::uint64_t h = 0;
  for (int i = 0; i < 8; ++i) h = rotl(h ^ lane[i], 27) * kP1 + kP2;
  h += bytes.size();
  if (out != nullptr) std::memcpy(out, p, n);
  for (; n > 0; --n, ++p) h = rotl(h ^ (static_cast<std::uint64_t>(*p) * kP1), 11) * kP2;
  h ^= h >> 33;
  h *= kP2;
  h ^= h >> 29;
  return h;
}

}  // namespace

std::uint64_t page_checksum(std::span<const std::byte> bytes) {
  return checksum_copy(bytes, nullptr);
}

void encode_tier_value(std::byte* out, const Key& space, const Key& key, const Key& parent,
                       std::span<const std::int32_t> tokens, std::span<const std::byte> page) {
  std::byte* p = out;
  put(p, kMagic);
  put(p, space.bytes);
  put(p, key.bytes);
  put(p, parent.bytes);
  put(p, static_cast<std::uint32_t>(tokens.size()));
  put(p, std::uint32_t{0});
  put(p, static_cast<std::uint64_t>(page.size()));
  std::byte* checksum_at = p;
  p += sizeof(std::uint64_t);
  std::memcpy(p, tokens.data(), tokens.size_bytes());
  p += tokens.size_bytes();
  const std::uint64_t checksum = checksum_copy(page, p);  // copies the page as it sums it
  std::memcpy(checksum_at, &checksum, sizeof checksum);
}

TierPage check_tier_record(std::span<const std::byte> value, const Key& space, const Key& key,
                           const Key& parent, std::span<const std::int32_t> tokens,
                           std::size_t page_bytes, std::string& why) {
  const std::size_t want = kHeader + tokens.size_bytes() + page_bytes;
  if (value.size() != want) {
    why = "value of " + std::to_string(value.size()) + " bytes, not " + std::to_string(want) +
          " (truncated, or another layout's)";
    return {};
  }
  const std::byte* p = value.data();
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
  if (std::memcmp(p, tokens.data(), tokens.size_bytes()) != 0) {
    why = "other tokens (a key collision)";
    return {};
  }
  p += tokens.size_bytes();
  return {{p, page_bytes}, checksum};
}

namespace {
constexpr const char* kTorn = "page bytes do not match their checksum (overwritten or torn)";
}  // namespace

bool copy_tier_page(const TierPage& page, std::byte* out, std::string& why) {
  if (checksum_copy(page.bytes, out) == page.checksum) return true;
  why = kTorn;
  return false;
}

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
