#include "hicache/hash_chain.hpp"

#include <algorithm>
#include <bit>
#include <cstring>
#include <stdexcept>

#include "blake2b.hpp"

namespace hicache {

std::string Key::hex() const {
  static const char* digits = "0123456789abcdef";
  std::string s(32, '0');
  for (std::size_t i = 0; i < bytes.size(); ++i) {
    s[2 * i] = digits[bytes[i] >> 4];
    s[2 * i + 1] = digits[bytes[i] & 15];
  }
  return s;
}

Key chain_step(std::span<const std::uint8_t> prefix, std::span<const std::int32_t> tokens) {
  detail::Blake2b h(16);
  h.update(prefix.data(), prefix.size());
  if constexpr (std::endian::native == std::endian::little) {
    h.update(tokens.data(), tokens.size_bytes());
  } else {
    for (std::int32_t t : tokens) {
      const auto u = static_cast<std::uint32_t>(t);
      const std::uint8_t le[4] = {static_cast<std::uint8_t>(u), static_cast<std::uint8_t>(u >> 8),
                                  static_cast<std::uint8_t>(u >> 16),
                                  static_cast<std::uint8_t>(u >> 24)};
      h.update(le, 4);
    }
  }
  Key k;
  h.finish(k.bytes.data());
  return k;
}

namespace {

void truncate_key(Key& k, int key_bits) {
  for (int byte = 0; byte < 16; ++byte) {
    const int keep = std::clamp(key_bits - 8 * byte, 0, 8);
    k.bytes[static_cast<std::size_t>(byte)] &= static_cast<std::uint8_t>(0xFF00 >> keep);
  }
}

}  // namespace

std::vector<Key> chain_keys(std::string_view salt, std::span<const std::int32_t> tokens,
                            std::int64_t block_tokens, std::int64_t max_pages, int key_bits) {
  std::vector<Key> keys;
  extend_chain_keys(keys, salt, tokens, block_tokens, max_pages, key_bits);
  return keys;
}

void extend_chain_keys(std::vector<Key>& keys, std::string_view salt,
                       std::span<const std::int32_t> tokens, std::int64_t block_tokens,
                       std::int64_t max_pages, int key_bits) {
  if (block_tokens < 1) throw std::invalid_argument("block_tokens must be >= 1");
  if (key_bits < 1 || key_bits > 128) throw std::invalid_argument("key_bits must be in [1, 128]");
  const auto full = static_cast<std::int64_t>(tokens.size()) / block_tokens;
  const auto n = std::max<std::int64_t>(0, std::min(full, max_pages));
  keys.reserve(static_cast<std::size_t>(n));
  for (auto i = static_cast<std::int64_t>(keys.size()); i < n; ++i) {
    auto page = tokens.subspan(static_cast<std::size_t>(i * block_tokens),
                               static_cast<std::size_t>(block_tokens));
    keys.push_back(i == 0 ? chain_first(salt, page) : chain_next(keys.back(), page));
    if (key_bits < 128) truncate_key(keys.back(), key_bits);
  }
}

}  // namespace hicache
