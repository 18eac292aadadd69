#pragma once
// A segment table on the device and the launch of the gather/scatter kernel over it (internal to
// cpp/cuda). The copier keeps one table for whole pages (the kernel across PCIe) and one per
// staging group (the kernel between the engine's blocks and the device staging buffer).

#include <cuda_runtime.h>

#include <span>
#include <vector>

#include "hicache/copier.hpp"
#include "hicache/page_layout.hpp"
#include "page_copy_kernel.cuh"

namespace hicache::cuda {

/// The segments of `layout` as the kernel sees them, with their offsets in a host page;
/// first_tile is left to SegmentTable.
std::vector<SegmentDesc> segment_rows(const PageLayout& layout);

class SegmentTable {
 public:
  /// @param rows as segment_rows gives them (first_tile is assigned here).
  /// @param vec bytes per vector access (16, 4 or 1): every base, stride, size and offset must
  ///        be a multiple of it. @throws hicache::Error if the device table cannot be allocated.
  SegmentTable(std::vector<SegmentDesc> rows, int vec, int threads);
  ~SegmentTable();
  SegmentTable(const SegmentTable&) = delete;
  SegmentTable& operator=(const SegmentTable&) = delete;

  /// Enqueues copies of `moves` (engine block <-> address of the page's first byte, host or
  /// device) on `stream`, in launches of at most kMaxMovesPerLaunch pages.
  /// @throws hicache::Error if a launch fails.
  void launch(Direction dir, std::span<const PageMove> moves, int max_blocks,
              cudaStream_t stream) const;

  /// Loads every instantiation of the kernel now (see CudaCopier::bind for why).
  static void load_kernels();

  /// The table on the device (other kernels over the same pages read it too).
  const SegmentDesc* rows() const { return rows_; }
  int count() const { return count_; }

 private:
  SegmentDesc* rows_ = nullptr;  // device memory
  int count_ = 0;
  int vec_ = 16;
  int threads_ = 1024;
  long long tiles_per_page_ = 0;
};

}  // namespace hicache::cuda
