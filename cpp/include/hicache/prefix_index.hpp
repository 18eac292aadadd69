#pragma once
// The index: key -> entry, with an intrusive LRU list and a fixed number of host slots.
//
// One index per pool (pages, states). An entry is evictable only when it is idle (no transfer
// holds it: refs == 0) and ready (its device-to-host copy completed); entries waiting for their
// store hold a reference, so both conditions reduce to refs == 0.

#include <cstdint>
#include <deque>
#include <optional>
#include <span>
#include <vector>

#include "hicache/child_counts.hpp"
#include "hicache/entry_table.hpp"
#include "hicache/key.hpp"

namespace hicache {

struct Entry {
  Key key;
  /// Unique per entry ever created; a child records its parent's serial, so a page re-stored
  /// after its parent was evicted and replaced is never linked to the new parent by mistake.
  std::uint64_t serial = 0;
  /// Pages: serial of the parent page (or of the salt root for page 0).
  /// States: serial of the page that ends at the state's position.
  std::uint64_t parent_serial = 0;
  std::vector<std::int32_t> tokens;  ///< pages only: the page's tokens, compared on every hit
  std::int64_t slot = -1;            ///< host slot holding the bytes
  std::int32_t refs = 0;             ///< transfers (or an ongoing call) holding the entry
  bool ready = false;                ///< device-to-host copy completed: hit-able
  /// Pages fetched from a tier into a cache whose copier checks pages as it loads them: the
  /// checksum the page's bytes must have, until its first load checked them.
  std::optional<std::uint64_t> unchecked;
  /// Pages found by content (PrefixIndex::add_edge): the edge's table key, 0 if none.
  std::uint64_t edge = 0;

  Entry* lru_prev = nullptr;  ///< towards least recently used
  Entry* lru_next = nullptr;  ///< towards most recently used
};

/// Which idle entry gives up its slot when the index is full.
enum class EvictionPolicy {
  /// The least recently used idle entry (DeepInfer's hicache). Chains are touched root first, so
  /// a root is older than its descendants and is evicted first, stranding them.
  kLru,
  /// The least recently used idle entry that no cached entry names as its parent. Chains are
  /// touched leaf first, so within a chain leaves age first; a page is never evicted before its
  /// cached descendants, so nothing is stranded while its ancestors are evicted.
  kLeafFirst,
};

class PrefixIndex {
 public:
  /// @throws std::invalid_argument if capacity < 0.
  explicit PrefixIndex(std::int64_t capacity, EvictionPolicy policy = EvictionPolicy::kLru);
  PrefixIndex(const PrefixIndex&) = delete;
  PrefixIndex& operator=(const PrefixIndex&) = delete;

  Entry* find(const Key& key);
  /// Hints the CPU to fetch where find(key) will look (callers walking a chain prefetch ahead).
  void prefetch(const Key& key) const { table_.prefetch(key); }

  /// Creates an entry for an absent key at the most-recently-used end, not ready, holding one
  /// reference (its pending store). Takes a free slot, else evicts the least recently used idle
  /// entry. Returns nullptr, changing nothing, when every slot is held. `evicted`, if given,
  /// receives the key of the entry evicted to make room (or nullopt).
  Entry* insert(const Key& key, std::uint64_t serial, std::uint64_t parent_serial,
                std::optional<Key>* evicted = nullptr);

  /// Removes an idle entry and frees its slot. @throws std::logic_error if it is held.
  void erase(Entry* e);

  /// Marks as most recently used.
  void touch(Entry* e);
  /// Marks a prefix chain (root first) as used: leaf-first touches it leaf first, so the root
  /// ends most recently used and leaves age first; LRU touches it root first.
  void touch_chain(std::span<Entry* const> chain);
  void pin(Entry* e) { busy_ += e->refs++ == 0 ? 1 : 0; }
  void unpin(Entry* e);

  std::int64_t size() const { return static_cast<std::int64_t>(table_.size()); }
  std::int64_t capacity() const { return capacity_; }
  /// Whether an insert would have to evict.
  bool full() const { return size() >= capacity_; }
  std::int64_t evictions() const { return evictions_; }
  /// Content edges, for pages that carry tokens: an entry may also be found by its parent's
  /// serial and a fingerprint of its tokens, so that a walk along a prompt whose pages are
  /// cached needs no chain key (hashing a page with BLAKE2b costs several times more than
  /// fingerprinting and comparing its tokens). find_edge may return another entry (fingerprints
  /// and the edge table's keys can collide): callers check its parent and compare its tokens.
  /// An edge is dropped with its entry; at most one entry holds a given edge (a second is found
  /// by its key only).
  void add_edge(Entry* e, std::uint64_t fingerprint);
  Entry* find_edge(std::uint64_t parent_serial, std::uint64_t fingerprint) const;

  /// Whether some entry names `serial` as its parent (a salt root: whether any page 0 uses it).
  bool has_children(std::uint64_t serial) const { return children_.contains(serial); }
  /// Entries held by a transfer or pending their store.
  std::int64_t busy() const { return busy_; }

  /// Least recently used first (tests and the reference comparison).
  std::vector<const Entry*> lru_order() const;

 private:
  void link_mru(Entry* e);
  void unlink(Entry* e);
  std::int64_t take_slot(std::optional<Key>* evicted);
  void prefetch_next_victim() const;
  void forget_child(const Entry* e);
  void drop(Entry* e);  // out of the table, the LRU list and its parent's children

  EntryTable<Entry> table_;
  std::deque<Entry> entries_;         // stable addresses: transfers hold Entry*
  std::vector<Entry*> free_entries_;  // erased entries, reused by insert
  Entry* lru_head_ = nullptr;         // least recently used
  Entry* lru_tail_ = nullptr;         // most recently used
  std::vector<std::int64_t> free_slots_;
  std::int64_t next_unused_slot_ = 0;
  std::int64_t capacity_;
  std::int64_t evictions_ = 0;
  std::int64_t busy_ = 0;
  EvictionPolicy policy_;
  ChildCounts children_;                         // parent serial -> cached children
  EntryTable<Entry, EdgeOfEntry<Entry>> edges_;  // (parent, content) -> entry
};

}  // namespace hicache
