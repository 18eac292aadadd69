#pragma once
// A 16-byte chain key: BLAKE2b-128 of (previous key or salt) followed by one page's tokens.

#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

namespace hicache {

/// The digest identifying a token prefix up to the end of one page.
struct Key {
  std::array<std::uint8_t, 16> bytes{};

  friend bool operator==(const Key& a, const Key& b) {
    // Two 8-byte compares, not a memcmp call: the index compares keys on every lookup.
    std::uint64_t a0, a1, b0, b1;
    std::memcpy(&a0, a.bytes.data(), 8);
    std::memcpy(&a1, a.bytes.data() + 8, 8);
    std::memcpy(&b0, b.bytes.data(), 8);
    std::memcpy(&b1, b.bytes.data() + 8, 8);
    return a0 == b0 && a1 == b1;
  }
  friend bool operator!=(const Key& a, const Key& b) { return !(a == b); }

  /// Lower-case hex, 32 characters (for logs and tests).
  std::string hex() const;
};

/// Hash functor for unordered containers: a BLAKE2b digest is already uniform, so its first
/// eight bytes are a good hash.
struct KeyHash {
  std::size_t operator()(const Key& k) const noexcept {
    std::uint64_t h;
    std::memcpy(&h, k.bytes.data(), sizeof h);
    return static_cast<std::size_t>(h);
  }
};

}  // namespace hicache
