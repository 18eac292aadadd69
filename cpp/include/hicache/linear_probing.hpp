#pragma once
// What the index's open-addressed tables (EntryTable, ChildCounts; and the admission policy's
// FlatLru; internal, not for engines) share: where a key's probe starts, and backward-shift
// deletion.

#include <cstddef>
#include <cstdint>
#include <vector>

namespace hicache::detail {

/// The home slot of `key` in a table of 2^(64 - shift) slots: Fibonacci hashing, so that keys
/// that are not uniform (consecutive serials, tests' keys of few bits) spread over the table
/// instead of filling neighbouring slots as one long run.
inline std::size_t fibonacci_home(std::uint64_t key, int shift) {
  return static_cast<std::size_t>((key * 0x9e3779b97f4a7c15ULL) >> shift);
}

/// Empties slots[i] (a power-of-two table), moving back each later member of its run whose home
/// slot is not cyclically within (hole, its place]: backward-shift deletion, which needs no
/// tombstones and leaves probes as short as if the erased key had never been there.
/// `empty(slot)` says whether a slot is free, `home(slot)` where its key's probe starts; a
/// default-constructed Slot is an empty one.
template <class Slot, class Empty, class Home>
void erase_and_shift_back(std::vector<Slot>& slots, std::size_t i, Empty&& empty, Home&& home) {
  const std::size_t mask = slots.size() - 1;
  for (std::size_t j = (i + 1) & mask;; j = (j + 1) & mask) {
    if (empty(slots[j])) break;
    const std::size_t h = home(slots[j]);
    const bool stays = (i <= j) ? (i < h && h <= j) : (i < h || h <= j);
    if (stays) continue;
    slots[i] = slots[j];
    i = j;
  }
  slots[i] = Slot{};
}

}  // namespace hicache::detail
