#pragma once
// PageStore: pages an engine names with its own keys (SGLang's page hashes), kept in a Tier
// (a disk directory, Mooncake Store, memory) as hicache's checked values.
//
// An engine that has a host pool of its own and asks a storage backend to back it up (SGLang's
// HiCache: `batch_set_v1(keys, host_indices)`, `batch_get_v1`, `batch_exists`) gives hicache
// neither tokens nor a block table, only page names and where each page's pieces lie in its
// host pool. PageStore writes each page as one value: the pieces gathered, summed on the way,
// then hicache's record (tier_record.hpp) carrying the page's key, its parent's key (the key
// before it in the engine's chain) and the space (the engine's model, format and rank, and the
// pieces' sizes). A get checks all of them and the page's checksum, so a value that another
// model, layout or rank wrote under the same name, a value whose chain differs, a torn or
// damaged value is a miss, counted, never bytes in the engine's pool.
//
// A call's pages go to the tier in chunks of about 32 MiB, two in flight: the next chunk is
// gathered (or the last one checked and scattered) while the tier moves this one.
//
// Thread safety: calls may come from several threads at once (SGLang's backup and prefetch
// threads); tier calls are serialised (a Tier takes one call at a time), waits are not; puts
// run one at a time, as do gets (each direction keeps its two staging buffers). The
// tier should not be shared with another PageStore or cache (each serialises on its own).

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <unordered_set>
#include <vector>

#include "hicache/key.hpp"
#include "hicache/tier.hpp"

namespace hicache {

struct PageStoreOptions {
  /// Names the engine's model, KV format and rank: values of another space are never read.
  std::string space = "default";
  /// Bytes of each piece of a page, in order (SGLang: a K and a V piece per layer, or one K and
  /// one V piece a page); every page has these pieces.
  std::vector<std::size_t> piece_bytes;
  /// A batch the tier has not completed after this long is given up (its pages fail).
  std::chrono::microseconds timeout{std::chrono::seconds(30)};
  /// @throws std::invalid_argument naming the bad field.
  void validate() const;
};

struct PageStoreStats {
  std::int64_t pages_put = 0;  ///< values the tier took
  std::int64_t pages_put_failed = 0;
  std::int64_t pages_got = 0;       ///< values read, checked and scattered into the pool
  std::int64_t pages_missing = 0;   ///< asked for, not in the tier
  std::int64_t pages_rejected = 0;  ///< in the tier but failed the record or checksum check
  std::int64_t tier_errors = 0;  ///< values (or names) the tier failed on: connection, I/O, timeout
  std::string last_error;
};

class PageStore {
 public:
  /// @throws std::invalid_argument for a null tier or bad options.
  PageStore(std::shared_ptr<Tier> tier, PageStoreOptions options);
  ~PageStore();
  PageStore(const PageStore&) = delete;
  PageStore& operator=(const PageStore&) = delete;

  std::size_t page_bytes() const { return page_bytes_; }
  std::size_t pieces() const { return options_.piece_bytes.size(); }
  const PageStoreOptions& options() const { return options_; }

  /// Writes pages keys[i] whose pieces start at `pieces[i * pieces() + j]`. keys[i]'s parent is
  /// keys[i - 1], and `first_parent` for keys[0] ("" for a chain's first page; nullopt when the
  /// engine does not say: SGLang without hicache_storage_pass_prefix_keys). Returns, per page,
  /// whether the tier took it; never throws for what the tier does.
  /// @throws std::invalid_argument if `pieces` does not hold pieces() addresses a key.
  std::vector<std::uint8_t> put(std::span<const std::string> keys,
                                const std::optional<std::string>& first_parent,
                                std::span<const std::uintptr_t> pieces);
  /// Reads pages keys[i] into the pieces at `pieces[i * pieces() + j]`. Returns, per page,
  /// whether it was found and checked; a page that failed leaves its pieces undefined (the
  /// engine must not use them: it uses the leading run that succeeded). With `first_parent`
  /// nullopt, keys[0]'s recorded parent is not compared (its key, space and bytes still are).
  std::vector<std::uint8_t> get(std::span<const std::string> keys,
                                const std::optional<std::string>& first_parent,
                                std::span<const std::uintptr_t> pieces);
  /// Whether the tier holds a value under each key's name (not checked until a get). A value
  /// that failed its check in a get is reported missing until a put writes it again, so the
  /// engine's next backup of that page replaces it instead of skipping it as stored (up to
  /// 65536 such keys are remembered; beyond that the memory starts afresh).
  std::vector<std::uint8_t> exists(std::span<const std::string> keys);

  /// The value's name in the tier for `key`.
  std::string value_name(const std::string& key) const;
  PageStoreStats stats() const;

 private:
  struct Flight;
  struct Staging;
  std::optional<std::vector<std::int64_t>> finish(std::int64_t batch, std::size_t n);
  void note_error(std::string what);
  std::size_t chunk_pages() const;
  void check_pieces(const char* what, std::size_t keys, std::size_t pieces) const;
  void remember_rejected(const std::string& key);

  std::shared_ptr<Tier> tier_;
  PageStoreOptions options_;
  std::size_t page_bytes_ = 0;
  std::size_t value_bytes_ = 0;
  Key space_;
  std::unique_ptr<Staging> put_staging_, get_staging_;  // two chunk buffers each, kept
  std::mutex tier_mu_;                                  // one tier call at a time
  mutable std::mutex stats_mu_;                         // also guards rejected_
  PageStoreStats stats_;
  std::unordered_set<std::string> rejected_;
};

}  // namespace hicache
