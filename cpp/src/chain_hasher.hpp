#pragma once
// ChainHasher (internal): one prompt's chain keys (hicache/hash_chain.hpp), extended in
// installments, as a lookup or a store needs them (a lookup stops at its first miss, a store
// copies each installment's pages while it hashes the next). The keys it starts from may come
// from elsewhere (the cached pages' entries): it continues from the last one.
//
// A page's key hashes its tokens first and the previous key last, so every page's token blocks
// can be hashed before the chain reaches it. The token blocks of each installment's pages (at
// most kMaxMidstates at a time) are hashed four pages side by side (Blake2b::update4), on the
// page threads if they are enough bytes to be worth threads; the installment then only finishes
// its keys, one block each, in chain order.
// (Lookups and stores find a prompt's cached pages by content, without their keys: they hash
// only the pages past them.)

#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include "blake2b.hpp"
#include "hicache/key.hpp"

namespace hicache::detail {

class ChainHasher {
 public:
  /// @throws std::invalid_argument if block_tokens < 1 or key_bits is not in [1, 128].
  ChainHasher(std::string_view salt, std::span<const std::int32_t> tokens,
              std::int64_t block_tokens, std::int64_t limit, int key_bits);
  /// Appends to `keys` (this chain's first keys.size() keys) the keys of the next pages, up to
  /// `upto` in all (and at most `limit` and the prompt's full pages).
  void extend(std::vector<Key>& keys, std::int64_t upto);
  /// Keys computed by every ChainHasher in the process so far (tests: which calls hash what).
  static std::uint64_t keys_hashed();

 private:
  static constexpr std::size_t kMaxMidstates = 8192;  // ~220 bytes each

  std::span<const std::int32_t> page(std::size_t i) const;
  void hash_blocks_ahead(std::size_t first, std::size_t end);

  std::span<const std::uint8_t> salt_;
  std::span<const std::int32_t> tokens_;
  std::size_t block_tokens_;
  std::size_t limit_;  // pages: min(limit, full pages)
  int key_bits_;
  std::vector<Blake2b> mids_;  // pages [mids_first_, mids_first_ + mids_.size())
  std::size_t mids_first_ = 0;
};

}  // namespace hicache::detail
