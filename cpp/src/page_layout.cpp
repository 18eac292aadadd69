#include "hicache/page_layout.hpp"

#include <stdexcept>
#include <string>

#include "first_repeat.hpp"

namespace hicache {

PageLayout::PageLayout(std::vector<Segment> segments, Device device)
    : segments_(std::move(segments)), device_(device) {
  if (segments_.empty()) return;  // state only
  num_blocks_ = segments_[0].num_blocks;
  for (std::size_t i = 0; i < segments_.size(); ++i) {
    const Segment& s = segments_[i];
    const std::string where = "segment " + std::to_string(i) + ": ";
    if (s.num_blocks <= 0) throw std::invalid_argument(where + "num_blocks must be positive");
    if (s.base == nullptr) throw std::invalid_argument(where + "null base pointer");
    if (s.num_blocks != num_blocks_) {
      throw std::invalid_argument(where + "has " + std::to_string(s.num_blocks) +
                                  " blocks but segment 0 has " + std::to_string(num_blocks_) +
                                  "; every segment must index the same blocks");
    }
    if (s.block_bytes <= 0) throw std::invalid_argument(where + "block_bytes must be positive");
    if (s.block_stride < s.block_bytes) {
      throw std::invalid_argument(where + "block_stride " + std::to_string(s.block_stride) +
                                  " is smaller than block_bytes " + std::to_string(s.block_bytes));
    }
    offsets_.push_back(page_bytes_);
    page_bytes_ += static_cast<std::size_t>(s.block_bytes);
  }
}

void PageLayout::check_blocks(std::span<const std::int64_t> blocks, bool require_unique,
                              std::string_view what) const {
  if (segments_.empty()) return;  // state only: pages have no blocks
  for (std::int64_t b : blocks) {
    if (b < 0 || b >= num_blocks_) {
      throw std::out_of_range(std::string(what) + ": block id " + std::to_string(b) +
                              " is outside [0, " + std::to_string(num_blocks_) + ")");
    }
  }
  if (!require_unique) return;
  if (const auto k = detail::first_repeat(blocks)) {
    throw std::invalid_argument(std::string(what) + ": block id " + std::to_string(blocks[*k]) +
                                " appears twice; each page needs its own block");
  }
}

}  // namespace hicache
