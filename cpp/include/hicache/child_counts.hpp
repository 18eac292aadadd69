#pragma once
// ChildCounts: parent serial -> how many cached entries name it as their parent, PrefixIndex's
// record for leaf-first eviction (internal; not for engines).
//
// Every page a store inserts adds a count and every page it evicts removes one, and leaf-first
// eviction asks for each idle entry it considers. A node-based std::unordered_map allocated and
// freed a node for most of those, with a cache miss or two each; here the counts live in one flat
// array (open addressing, linear probing, backward-shift deletion: linear_probing.hpp), so an
// operation is one probe of one cache line and never allocates once the table has grown.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "hicache/linear_probing.hpp"

namespace hicache {

class ChildCounts {
 public:
  ChildCounts() : slots_(16) {}

  /// Whether some entry names `parent` as its parent.
  bool contains(std::uint64_t parent) const { return slots_[probe(parent)].count != 0; }

  void add(std::uint64_t parent) {
    if (2 * (size_ + 1) > slots_.size()) grow();
    Slot& s = slots_[probe(parent)];
    if (s.count == 0) {
      s.parent = parent;
      ++size_;
    }
    ++s.count;
  }

  /// One child of `parent` fewer (nothing if it has none).
  void remove(std::uint64_t parent) {
    const std::size_t i = probe(parent);
    if (slots_[i].count == 0 || --slots_[i].count != 0) return;
    detail::erase_and_shift_back(
        slots_, i, [](const Slot& s) { return s.count == 0; },
        [this](const Slot& s) { return home(s.parent); });
    --size_;
  }

  /// Hints the CPU to fetch where `parent`'s probe starts.
  void prefetch(std::uint64_t parent) const { __builtin_prefetch(&slots_[home(parent)]); }

  /// Parents with at least one child.
  std::size_t size() const { return size_; }

  /// The longest run of occupied slots: the most a miss probes, or a removal shifts back, in one
  /// operation (tests bound it).
  std::size_t longest_run() const {
    std::size_t longest = 0, run = 0;
    for (std::size_t k = 0; k < 2 * slots_.size(); ++k) {  // twice round: a run may wrap
      run = slots_[k & (slots_.size() - 1)].count != 0 ? run + 1 : 0;
      longest = std::max(longest, run);
    }
    return std::min(longest, slots_.size());
  }

 private:
  struct Slot {
    std::uint64_t parent = 0;
    std::int64_t count = 0;  // 0: the slot is empty
  };
  // Fibonacci hashing of the serial (fibonacci_home). Serials are handed out in order, so a chain's
  // parents are consecutive integers: placed by their low bits they filled consecutive slots, one
  // run as long as the chains, which a removal shifts back (and a miss probes) to its end.
  // Leaf-first eviction removes a run's last member, but plain LRU eviction and branching prefixes
  // remove from its middle (`hicache replay --policy lru` spent a quarter of its time there).
  // Keeping groups of four consecutive serials in one cache line measured no faster, in the replay
  // or in stores.
  std::size_t home(std::uint64_t parent) const { return detail::fibonacci_home(parent, shift_); }
  std::size_t next(std::size_t i) const { return (i + 1) & (slots_.size() - 1); }
  // The slot holding `parent`, or the empty slot where it would go.
  std::size_t probe(std::uint64_t parent) const {
    std::size_t i = home(parent);
    while (slots_[i].count != 0 && slots_[i].parent != parent) i = next(i);
    return i;
  }
  void grow() {
    std::vector<Slot> old(slots_.size() * 2);
    old.swap(slots_);
    --shift_;
    for (const Slot& s : old) {
      if (s.count != 0) slots_[probe(s.parent)] = s;
    }
  }

  std::vector<Slot> slots_;
  std::size_t size_ = 0;
  int shift_ = 64 - 4;  // log2(16 slots)
};

}  // namespace hicache
