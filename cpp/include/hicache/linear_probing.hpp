#pragma once
// Backward-shift deletion for the index's open-addressed tables (EntryTable, ChildCounts;
// internal, not for engines): a table with linear probing and no tombstones empties a slot by
// moving later members of its probe run back into the hole, so probes stay as short as if the
// erased key had never been there.

#include <cstddef>
#include <vector>

namespace hicache::detail {

/// Empties slots[i] (a power-of-two table), moving back each later member of its run whose home
/// slot is not cyclically within (hole, its place]. `empty(slot)` says whether a slot is free,
/// `home(slot)` where its key's probe starts; a default-constructed Slot is an empty one.
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
