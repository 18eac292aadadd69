#pragma once
// BlockCatalog: the index half of hicache, for engines that look up, load and store in separate
// steps, possibly in separate processes (vLLM's scheduler decides, its workers copy).
//
// It knows which blocks are cached in which host slot and nothing of the bytes: the engine names
// blocks by its own keys (vLLM's chained block hashes, hashed into a 16-byte Key), asks for slots
// to store into, copies with a SlotMover (the copier half) wherever the slots' memory is mapped,
// then reports completion. Admission and eviction are the same as HostPrefixCache's: the
// AdmissionPolicy sees every batch of keys offered for storing, and leaf-first eviction never
// evicts a block before its cached descendants when the engine names each batch's parent.
//
// Lifecycle of a block: prepare_store -> pending (not loadable, not evictable) -> complete_store
// (success: loadable; failure: removed). prepare_load pins loadable blocks until complete_load.
//
// Threads: every method may be called from several threads at once.

#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <vector>

#include "hicache/admission_policy.hpp"
#include "hicache/key.hpp"
#include "hicache/prefix_index.hpp"

namespace hicache {

struct CatalogOptions {
  std::int64_t capacity_slots = 0;  ///< host slots (one block each)
  EvictionPolicy eviction = EvictionPolicy::kLeafFirst;
  Admission admission = Admission::kAdaptive;
  /// @throws std::invalid_argument naming the bad field.
  void validate() const;
};

struct CatalogStats {
  std::int64_t lookups = 0;
  std::int64_t lookup_hits = 0;      ///< lookups that found a loadable block
  std::int64_t blocks_loaded = 0;    ///< blocks handed out by prepare_load
  std::int64_t blocks_offered = 0;   ///< keys given to prepare_store
  std::int64_t blocks_stored = 0;    ///< stores completed successfully
  std::int64_t blocks_declined = 0;  ///< not stored: the admission policy declined them
  std::int64_t blocks_no_room = 0;   ///< not stored: every slot was held
  std::int64_t stores_failed = 0;    ///< blocks whose store completed with failure
  std::int64_t evictions = 0;
  std::int64_t used = 0;
  std::int64_t pending = 0;  ///< pinned: being stored or loaded
  std::int64_t capacity = 0;
  bool admitting_second_sightings_only = false;
};

class BlockCatalog {
 public:
  enum class Lookup { kMiss, kHit, kPending };

  struct StorePlan {
    std::vector<std::size_t> accepted;  ///< indices into the keys given, in order
    std::vector<std::int64_t> slots;    ///< one per accepted key
    std::vector<Key> evicted;           ///< blocks evicted to make room
  };

  /// Keys stored (loadable now) and removed (evicted, or a failed store) since the last call.
  struct Events {
    std::vector<Key> stored;
    std::vector<Key> removed;
  };

  explicit BlockCatalog(CatalogOptions options);

  Lookup lookup(const Key& key);

  /// Pins the blocks (not evictable until complete_load) and returns their slots.
  /// @throws std::invalid_argument naming the first key that is not cached and loadable;
  ///         nothing is pinned then.
  std::vector<std::int64_t> prepare_load(std::span<const Key> keys);
  /// @throws std::invalid_argument for a key that prepare_load did not pin.
  void complete_load(std::span<const Key> keys);

  /// Marks cached blocks among `keys` (a prefix, in order) as recently used; others are ignored.
  void touch(std::span<const Key> keys);

  /// `keys`: consecutive blocks of one prompt in prefix order; `parent`: the block before
  /// keys[0], if any. Keys already cached or pending are skipped; each other key, in order, is
  /// admitted by the admission policy and given a slot (evicting an idle block if needed). The
  /// first key declined, or for which every slot is held, ends the plan: its descendants are
  /// not stored without it.
  StorePlan prepare_store(std::span<const Key> keys, const std::optional<Key>& parent);
  /// success: the blocks become loadable; otherwise they are removed.
  /// @throws std::invalid_argument for a key that is not pending a store.
  void complete_store(std::span<const Key> keys, bool success);

  Events take_events();
  CatalogStats stats() const;
  /// Forgets every idle block (pending ones stay until completed). @return blocks removed.
  std::int64_t clear();

  /// For a front end that walks exact chains under its own lock (HostPrefixCache, whose entries
  /// also carry their tokens and whose keys hash a salt): the index, the admission policy and
  /// fresh serials, used with chain_walk.hpp's walks as the methods above use them. Not
  /// synchronized: mixing these with the methods above needs the front end's own care.
  PrefixIndex& index() { return index_; }
  const PrefixIndex& index() const { return index_; }
  AdmissionPolicy& admission() { return *admission_; }
  const AdmissionPolicy& admission() const { return *admission_; }
  std::uint64_t& next_serial() { return next_serial_; }

 private:
  mutable std::mutex mu_;
  PrefixIndex index_;
  std::unique_ptr<AdmissionPolicy> admission_;
  std::uint64_t next_serial_ = 2;  // 1: the root of blocks whose parent is unknown
  Events events_;
  CatalogStats stats_;
};

}  // namespace hicache
