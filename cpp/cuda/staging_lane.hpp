#pragma once
// Staged copies (internal to cpp/cuda): pages cross PCIe on the DMA engines as large contiguous
// pieces, between host slots and a small device staging buffer, and move between that buffer and
// the engine's scattered blocks with the gather/scatter kernel at HBM speed.
//
// Why: a host page is contiguous, but in a layer-major pool its bytes are scattered over the GPU
// in chunks of 16-256 KiB. Across PCIe, a copy kernel reaches ~0.92 of the DMA rate, and the DMA
// engines lose even more on such chunks (0.84-0.91 at 256 KiB, measured on an H200). Staging gives
// the DMA engines one piece per page (or per window of pages) and leaves the kernel the part it
// is good at: the scatter within the GPU's own memory, whose bandwidth is far above the link's,
// so the SMs are busy for a small part of the transfer.
//
// Ordering: a lane has its own DMA stream and a buffer of `windows` windows; CUDA events order
// each window's reuse between the DMA stream and the caller's stream. The caller's stream sees
// the copy as if it ran there: a load's last scatter runs on it, and a store ends with a wait on
// its last DMA, so a fence recorded on the caller's stream after copy() covers everything.
// With priority_kernels the gathers/scatters run on the lane's own stream, after an event that
// marks the caller's earlier work, and the caller waits for the last of them (loads) or the
// last DMA (stores): the same ordering, seen from the caller's stream.

#include <cuda_runtime.h>

#include <cstddef>
#include <memory>
#include <mutex>
#include <span>
#include <vector>

#include "hicache/copier.hpp"
#include "hicache/page_layout.hpp"
#include "segment_table.hpp"

namespace hicache::cuda {

/// How a page is cut into staging windows: consecutive segments grouped so that a group fits a
/// window. With one group, a window holds `pages_per_window` whole pages.
struct StagingPlan {
  struct Group {
    std::size_t host_offset = 0;          // where the group starts in a host page
    std::size_t bytes = 0;                // bytes of the group in one page
    std::unique_ptr<SegmentTable> table;  // its segments, offsets relative to the group
  };
  std::vector<Group> groups;
  std::size_t window_bytes = 0;
  std::size_t pages_per_window = 1;

  /// @param window_target bytes a window should hold; a group larger than that (one segment
  ///        bigger than the window) widens the window to fit it.
  StagingPlan(const PageLayout& layout, std::size_t window_target, int vec, int threads);
};

class StagingLane {
 public:
  /// Allocates `windows` windows of plan.window_bytes on the current device and a DMA stream.
  /// @param priority_kernels run the gathers/scatters on a stream of the lane's own, of the
  ///        greatest priority, instead of the caller's: when compute holds the SMs, their CTAs go
  ///        first as SMs free up, so the DMA engine is not left waiting for a window.
  /// @throws hicache::Error if the device memory cannot be had.
  StagingLane(const StagingPlan& plan, int windows, bool priority_kernels);
  ~StagingLane();
  StagingLane(const StagingLane&) = delete;
  StagingLane& operator=(const StagingLane&) = delete;

  /// Enqueues the copy of `moves` (hosts are the pages' host slots). Thread-safe.
  /// @throws hicache::Error if a CUDA call fails.
  void copy(Direction dir, std::span<const PageMove> moves, int max_blocks, cudaStream_t caller);

 private:
  void dma(Direction dir, std::span<const PageMove> moves, const StagingPlan::Group& g,
           char* window);

  const StagingPlan& plan_;
  std::mutex mu_;
  char* buffer_ = nullptr;
  int windows_;
  int next_ = 0;
  cudaStream_t stream_ = nullptr;         // DMA
  cudaStream_t kernels_ = nullptr;        // priority_kernels only
  cudaEvent_t caller_ready_ = nullptr;    // priority_kernels: the caller's work before the copy
  std::vector<cudaEvent_t> dma_done_;     // per window: its last DMA
  std::vector<cudaEvent_t> kernel_done_;  // per window: its last gather or scatter
  std::vector<PageMove> staged_;          // scratch: moves rewritten to staging addresses
  std::vector<void*> src_, dst_;          // scratch: DMA pieces
  std::vector<std::size_t> sizes_;
};

}  // namespace hicache::cuda
