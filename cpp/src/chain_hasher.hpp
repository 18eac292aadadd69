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

#include <atomic>
#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include "blake2b.hpp"
#include "hicache/key.hpp"
#include "page_threads.hpp"

namespace hicache::detail {

class ChainHasher {
 public:
  /// @throws std::invalid_argument if block_tokens < 1 or key_bits is not in [1, 128].
  ChainHasher(std::string_view salt, std::span<const std::int32_t> tokens,
              std::int64_t block_tokens, std::int64_t limit, int key_bits);
  /// Appends to `keys` (this chain's first keys.size() keys) the keys of the next pages, up to
  /// `upto` in all (and at most `limit` and the prompt's full pages). With `published`, stores
  /// keys.size() there (release) as keys are added and notifies its waiters now and then: keys
  /// must then have room reserved for all of them (another thread reads the ones published).
  void extend(std::vector<Key>& keys, std::int64_t upto,
              std::atomic<std::size_t>* published = nullptr);
  /// The pages this chain has keys for: min(limit, the prompt's full pages).
  std::size_t limit() const { return limit_; }
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

/// A store's chain past its first installment, hashed on the background thread (BackgroundTask)
/// while the store walks, admits and copies the pages whose keys it has: a 1024-page store of
/// 16-token pages hashed them one BLAKE2b block a page, in chain order, for about half of its
/// CPU time (the null copier, this project's CPU machine). extend() hands over keys as they are
/// ready, waiting where the store caught up. Where the background thread is busy (another
/// store's chain) or the rest is short, extend() hashes on the caller's thread as before.
class ChainAhead {
 public:
  /// Hands hashing from keys.size() on to the background if at least kLeast pages are left.
  /// `hasher` (and the tokens it reads) must outlive this object, and is the background's until
  /// then: call only extend() meanwhile.
  ChainAhead(ChainHasher& hasher, const std::vector<Key>& keys);
  /// Waits for the background's work (it reads the tokens).
  ~ChainAhead() = default;
  ChainAhead(const ChainAhead&) = delete;
  ChainAhead& operator=(const ChainAhead&) = delete;
  /// Appends to `keys` (the chain's first keys.size() keys) where the background hashes: every
  /// key it has ready, waiting until there are `least` in all at least (at most the chain's);
  /// elsewhere: ChainHasher::extend(keys, upto). The store takes what is ready so that it never
  /// waits for more than its next few pages: asking for twice the keys it had, as it does on its
  /// own, kept it waiting for each installment's last key, so that only half of the chain's
  /// hashing overlapped its work.
  void extend(std::vector<Key>& keys, std::int64_t least, std::int64_t upto);

  /// Whether the background took the chain (tests).
  bool started() const { return started_; }

  /// Pages left to hash below which the hand-over (waking a thread) is not worth it.
  static constexpr std::size_t kLeast = 64;

 private:
  static constexpr std::size_t kFailed = ~std::size_t{0};  // published_: the background threw
  ChainHasher& hasher_;
  std::vector<Key> ahead_;                 // the background's: room reserved for the whole chain
  const Key* keys_ = nullptr;              // ahead_.data(), read here while the background appends
  std::atomic<std::size_t> published_{0};  // ahead_[0, published_) are final
  bool running_ = false;                   // started, and not every key handed over yet
  bool started_ = false;
  BackgroundTask task_;  // last: waited for before the members above go
};

}  // namespace hicache::detail
