#pragma once
// The pieces of one DMA submission, joined where they continue each other (internal to
// cpp/cuda; plain C++, so the CPU tests check it).
//
// The DMA path submits a piece per page and segment, and each piece costs the calling thread
// 0.4-0.9 us in the driver (docs/performance.md, "Where a store of small pages spends its call"),
// which is what a store's call and a store and a load issued together wait for. A page-major
// pool's page is one piece; where its host slot and its engine block both follow (or both
// precede) the piece before, the two are one copy of twice the bytes. Stores into the slots an
// eviction freed take adjacent slots, an old chain's leaf first, and an engine's allocator may
// hand a request consecutive blocks, so such runs come in either direction.
//
// A joined piece must stay within one allocation on each side: the caller joins only the pieces
// of one segment (consecutive blocks of one engine tensor), and host slots that touch lie in one
// pool chunk (HostPool::kChunkGap).

#include <cstddef>
#include <vector>

namespace hicache::cuda {

/// DMA pieces the copier submits in one cudaMemcpyBatchAsync (cuda_copier.cu, copy_pages_dma;
/// bench/research/slot_runs.cpp counts pieces by the same batches).
inline constexpr std::size_t kDmaBatch = 128;

class DmaPieces {
 public:
  /// @param limit the pieces one submission takes at most.
  explicit DmaPieces(std::size_t limit) : limit_(limit) {
    dst_.reserve(limit);
    src_.reserve(limit);
    sizes_.reserve(limit);
  }

  /// Adds dst <- src (bytes). With `may_join`, a piece that continues the last one on both
  /// sides (both right after it, or both right before it) grows it instead of adding one, so a
  /// run grows across a full submission's end.
  /// @return false if it needs a piece of its own and `limit` pieces are there already: submit
  ///         them, clear(), and add it again.
  bool add(void* dst, void* src, std::size_t bytes, bool may_join) {
    if (may_join && !sizes_.empty()) {
      char* const d = static_cast<char*>(dst);
      char* const s = static_cast<char*>(src);
      char* const last_d = static_cast<char*>(dst_.back());
      char* const last_s = static_cast<char*>(src_.back());
      const std::size_t n = sizes_.back();
      if (last_d + n == d && last_s + n == s) {  // right after it
        sizes_.back() += bytes;
        return true;
      }
      if (d + bytes == last_d && s + bytes == last_s) {  // right before it
        dst_.back() = dst;
        src_.back() = src;
        sizes_.back() += bytes;
        return true;
      }
    }
    if (sizes_.size() == limit_) return false;
    dst_.push_back(dst);
    src_.push_back(src);
    sizes_.push_back(bytes);
    return true;
  }

  std::size_t size() const { return sizes_.size(); }
  void clear() {
    dst_.clear();
    src_.clear();
    sizes_.clear();
  }
  void** dst() { return dst_.data(); }
  void** src() { return src_.data(); }
  std::size_t* sizes() { return sizes_.data(); }

 private:
  std::size_t limit_;
  std::vector<void*> dst_;
  std::vector<void*> src_;
  std::vector<std::size_t> sizes_;
};

}  // namespace hicache::cuda
