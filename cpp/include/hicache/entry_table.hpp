#pragma once
// EntryTable: key -> entry pointer, PrefixIndex's lookup structures (internal; not for engines):
// open addressing with linear probing over a flat array. By chain key (KeyOfEntry), and by
// content edge (EdgeOfEntry: PrefixIndex::add_edge).
//
// The index looks a key up for every page of every lookup and store; a node-based
// std::unordered_map costs two or three cache misses a lookup (bucket, node, and a modulo by a
// prime). Here a slot holds the key's first eight bytes beside the pointer, so a probe touches
// one cache line and the entry only on a tag match. Entries live elsewhere (their addresses
// never change). Erase shifts later slots back (no tombstones), so probes stay short. The table
// starts at 16 slots and doubles at half full: an idle index costs nothing.

#include <cstdint>
#include <cstring>
#include <vector>

#include "hicache/key.hpp"
#include "hicache/linear_probing.hpp"

namespace hicache {

/// An entry's chain key (a `Key key` member); the tag is its first eight bytes.
template <class E>
struct KeyOfEntry {
  using K = Key;
  static const Key& of(const E* e) { return e->key; }
  static std::uint64_t tag(const Key& k) {
    std::uint64_t t;
    std::memcpy(&t, k.bytes.data(), sizeof t);
    return t;
  }
};

/// An entry's content edge (a `std::uint64_t edge` member): its own tag.
template <class E>
struct EdgeOfEntry {
  using K = std::uint64_t;
  static const std::uint64_t& of(const E* e) { return e->edge; }
  static std::uint64_t tag(std::uint64_t k) { return k; }
};

/// E: an entry type; By: which of its members keys the table (it must not change while the
/// entry is in the table).
template <class E, class By = KeyOfEntry<E>>
class EntryTable {
  using K = typename By::K;

 public:
  EntryTable() : slots_(16) {}

  E* find(const K& key) const {
    const std::uint64_t t = By::tag(key);
    for (std::size_t i = home(t);; i = next(i)) {
      const Slot& s = slots_[i];
      if (s.entry == nullptr) return nullptr;
      if (s.tag == t && By::of(s.entry) == key) return s.entry;
    }
  }

  /// Hints the CPU to fetch the slot where key's probe starts (a large table misses the caches).
  void prefetch(const K& key) const { __builtin_prefetch(&slots_[home(By::tag(key))]); }

  /// The key must be absent.
  void insert(E* e) {
    if (2 * (size_ + 1) > slots_.size()) grow();
    place(e);
    ++size_;
  }

  /// The entry must be present.
  void erase(const E* e) {
    std::size_t i = home(By::tag(By::of(e)));
    while (slots_[i].entry != e) i = next(i);
    detail::erase_and_shift_back(
        slots_, i, [](const Slot& s) { return s.entry == nullptr; },
        [this](const Slot& s) { return home(s.tag); });
    --size_;
  }

  std::size_t size() const { return size_; }

 private:
  struct Slot {
    std::uint64_t tag = 0;
    E* entry = nullptr;
  };
  // Keys from tests with few key bits are not uniform.
  std::size_t home(std::uint64_t t) const { return detail::fibonacci_home(t, shift_); }
  std::size_t next(std::size_t i) const { return (i + 1) & (slots_.size() - 1); }
  void place(E* e) {
    const std::uint64_t t = By::tag(By::of(e));
    std::size_t i = home(t);
    while (slots_[i].entry != nullptr) i = next(i);
    slots_[i] = {t, e};
  }
  void grow() {
    std::vector<Slot> old(slots_.size() * 2);
    old.swap(slots_);
    --shift_;
    for (const Slot& s : old) {
      if (s.entry != nullptr) place(s.entry);
    }
  }

  std::vector<Slot> slots_;
  int shift_ = 64 - 4;  // log2(16 slots)
  std::size_t size_ = 0;
};

}  // namespace hicache
