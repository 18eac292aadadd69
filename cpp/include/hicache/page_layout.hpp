#pragma once
// Segments and the page they make up.
//
// A segment is one GPU (or CPU) KV tensor of the engine whose first dimension is the block id.
// A page is the concatenation of one block's bytes across all segments, in segment order: one
// segment is a page-major pool, several are layer-major pools (per-layer K and V, or one MLA
// latent tensor per layer).

#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include "hicache/device.hpp"

namespace hicache {

struct Segment {
  void* base = nullptr;           ///< address of block 0
  std::int64_t num_blocks = 0;    ///< first dimension of the tensor
  std::int64_t block_stride = 0;  ///< bytes from one block to the next
  std::int64_t block_bytes = 0;   ///< bytes of one block, contiguous from its start
};

class PageLayout {
 public:
  /// No segments: a state-only layout (a model without full-attention layers). Its pages hold
  /// no bytes and no block ids are checked; the cache keeps its index for the states.
  /// @throws std::invalid_argument if a base is null, sizes are not positive, a stride is
  ///         smaller than the block, or segments disagree on num_blocks.
  PageLayout(std::vector<Segment> segments, Device device);

  const std::vector<Segment>& segments() const { return segments_; }
  Device device() const { return device_; }
  std::int64_t num_blocks() const { return num_blocks_; }
  /// Sum of block_bytes over segments: the bytes of one host page.
  std::size_t page_bytes() const { return page_bytes_; }
  /// Offset of segment s inside a host page.
  std::size_t page_offset(std::size_t s) const { return offsets_[s]; }
  /// Where segment s - 1 ends in a host page (page_bytes() for s = the number of segments).
  std::size_t page_offset_end(std::size_t s) const {
    return s < offsets_.size() ? offsets_[s] : page_bytes_;
  }
  /// Bytes of segments [first, last) in a host page (one layer's, for layer-wise loads).
  std::size_t range_bytes(std::size_t first, std::size_t last) const {
    return page_offset_end(last) - page_offset(first);
  }
  std::byte* block_address(std::size_t s, std::int64_t block) const {
    const Segment& seg = segments_[s];
    return static_cast<std::byte*>(seg.base) + block * seg.block_stride;
  }

  /// @throws std::out_of_range naming `what` (where the ids came from) and the block id if it is
  ///         not in [0, num_blocks); std::invalid_argument if require_unique and an id repeats.
  void check_blocks(std::span<const std::int64_t> blocks, bool require_unique,
                    std::string_view what) const;

 private:
  std::vector<Segment> segments_;
  std::vector<std::size_t> offsets_;
  Device device_;
  std::int64_t num_blocks_ = 0;
  std::size_t page_bytes_ = 0;
};

}  // namespace hicache
