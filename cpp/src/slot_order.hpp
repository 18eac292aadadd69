#pragma once
// A store's new pages given their host slots in the order of their engine blocks (internal), for
// copiers that move a run of pages whose slots and blocks both follow each other as one copy
// (Copier::joins_runs: the CUDA copier's DMA path on one-segment pages, a piece a run).
//
// Why: a store into a full pool takes the slots its evictions free, an old chain's leaf first,
// so adjacent slots come in the reverse of the order that chain was stored in, while the blocks
// an engine hands one request often follow each other forwards. Page by page the two runs cross
// and no copies join; given the same slots in the blocks' order, a run of both is one copy.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <numeric>
#include <span>
#include <utility>
#include <vector>

#include "hicache/copier.hpp"
#include "hicache/prefix_index.hpp"

namespace hicache::detail {

/// pages[i] is moves[i]'s entry, inserted by this store (pending: no one reads its slot yet).
/// Reassigns the same slots (and their host addresses) so that they ascend as the blocks do: the
/// page of the k-th smallest block gets the k-th smallest slot, pages of one block in the order
/// given. Sums that go by slot (PageMove::sum_at_fence) are the caller's to set afterwards.
inline void slots_in_block_order(std::span<PageMove> moves, std::span<Entry* const> pages) {
  const std::size_t n = moves.size();
  if (n < 2) return;
  std::vector<std::pair<std::int64_t, std::byte*>> slots(n);  // (slot, its host address)
  for (std::size_t i = 0; i < n; ++i) slots[i] = {pages[i]->slot, moves[i].host};
  std::sort(slots.begin(), slots.end(),
            [](const auto& a, const auto& b) { return a.first < b.first; });
  std::vector<std::size_t> by_block(n);
  std::iota(by_block.begin(), by_block.end(), std::size_t{0});
  std::stable_sort(by_block.begin(), by_block.end(),
                   [&](std::size_t a, std::size_t b) { return moves[a].block < moves[b].block; });
  for (std::size_t k = 0; k < n; ++k) {
    const std::size_t i = by_block[k];
    pages[i]->slot = slots[k].first;
    moves[i].host = slots[k].second;
  }
}

}  // namespace hicache::detail
