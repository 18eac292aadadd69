#pragma once
// first_repeat: where a list of non-negative ids first names an id it named before. The argument
// checks that refuse a destination named twice (two copies into one place race) run it on every
// load's block ids and on the split API's copies, over up to thousands of ids; a
// std::unordered_set allocated a node for each id, which was 30 % of the CPU time of a 1024-page
// lookup (null copier, this project's 2-core machine). Here: open addressing over one array of
// twice the ids' count.

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <vector>

namespace hicache::detail {

/// The index of the first id equal to an earlier one, or nullopt if they are all different.
/// @pre every id >= 0 (callers check the range first).
inline std::optional<std::size_t> first_repeat(std::span<const std::int64_t> ids) {
  if (ids.size() < 2) return std::nullopt;
  int bits = 4;
  while ((std::size_t{1} << bits) < 2 * ids.size()) ++bits;
  const std::size_t mask = (std::size_t{1} << bits) - 1;
  std::vector<std::int64_t> table(mask + 1, -1);  // -1: empty
  for (std::size_t k = 0; k < ids.size(); ++k) {
    const std::int64_t id = ids[k];
    // Fibonacci hashing: engines hand out block ids and slots in runs.
    std::size_t i = static_cast<std::size_t>(
        (static_cast<std::uint64_t>(id) * 0x9e3779b97f4a7c15ULL) >> (64 - bits));
    while (table[i] != -1) {
      if (table[i] == id) return k;
      i = (i + 1) & mask;
    }
    table[i] = id;
  }
  return std::nullopt;
}

}  // namespace hicache::detail
