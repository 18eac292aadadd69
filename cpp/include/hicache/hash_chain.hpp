#pragma once
// The hash chain over a prompt.
//
//   key_0 = blake2b(tokens[0:B]       as int32 little-endian || salt,    digest_size=16)
//   key_i = blake2b(tokens[iB:(i+1)B] as int32 little-endian || key_i-1, digest_size=16)
//
// Bit-identical to Python's hashlib.blake2b, so keys are stable across processes and machines.
// The previous key comes last so that most of the work does not wait for it: a page's token
// blocks (four of the five BLAKE2b blocks of a 128-token page) are hashed on several threads for
// long prompts, and only the last block follows the chain (chain_keys).

#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include "hicache/key.hpp"

namespace hicache {

/// BLAKE2b with a 16-byte digest over `tokens` (int32 LE) followed by `suffix`.
Key chain_step(std::span<const std::int32_t> tokens, std::span<const std::uint8_t> suffix);

/// Key of the next page given the previous page's key.
inline Key chain_next(const Key& prev, std::span<const std::int32_t> tokens) {
  return chain_step(tokens, prev.bytes);
}

/// Key of the first page: the salt (any bytes, empty by default) is the chain's root.
inline Key chain_first(std::string_view salt, std::span<const std::int32_t> tokens) {
  return chain_step(tokens, {reinterpret_cast<const std::uint8_t*>(salt.data()), salt.size()});
}

/// Keys of the first `max_pages` full pages of `tokens` (fewer if the prompt is shorter).
/// @param key_bits 128 for real use. Tests pass fewer to force collisions: each key keeps only
///        its first key_bits bits (the rest zero) before it seeds the next one, so a collision
///        propagates down the chain exactly as a real one would.
/// @throws std::invalid_argument if block_tokens < 1 or key_bits is not in [1, 128].
std::vector<Key> chain_keys(std::string_view salt, std::span<const std::int32_t> tokens,
                            std::int64_t block_tokens, std::int64_t max_pages = INT64_MAX,
                            int key_bits = 128);

/// Appends to `keys` (the chain's first keys.size() keys, for the same salt, tokens and
/// key_bits) the keys of the next pages, up to `max_pages` in all: chain_keys in installments.
/// @throws std::invalid_argument as chain_keys.
void extend_chain_keys(std::vector<Key>& keys, std::string_view salt,
                       std::span<const std::int32_t> tokens, std::int64_t block_tokens,
                       std::int64_t max_pages, int key_bits = 128);

}  // namespace hicache
