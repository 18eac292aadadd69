#pragma once
// Staged copies (internal to cpp/cuda): pages cross PCIe on the DMA engines as large contiguous
// pieces, between host slots and a small device staging buffer, and move between that buffer and
// the engine's scattered blocks with the gather/scatter kernel at HBM speed.
//
// Why: a host page is contiguous, but in a layer-major pool its bytes are scattered over the GPU
// in chunks of 16-256 KiB. Across PCIe, a copy kernel reaches ~0.92 of the DMA rate, and the DMA
// engines lose even more on such chunks (0.84-0.91 at 256 KiB, measured on an H200). Staging gives
// the DMA engines one piece per page (or per run of adjacent host slots) and leaves the kernel
// the part it is good at: the scatter within the GPU's own memory, whose bandwidth is far above
// the link's, so the SMs are busy for a small part of the transfer.
//
// A window always holds whole pages: a page cut over several windows (as an 8.6 MiB MLA page was
// in 8 MiB windows) costs a DMA piece and a launch per part, and ran at 0.55 of the link.
//
// Ordering: a lane has its own DMA stream and two windows; CUDA events order each window's reuse
// between the DMA stream and the caller's stream. The caller's stream sees the copy as if it ran
// there: a load's scatters run on it, and a store ends with a wait on its last DMA, so a fence
// recorded on the caller's stream after copy() covers everything.

#include <cuda_runtime.h>

#include <array>
#include <cstddef>
#include <memory>
#include <mutex>
#include <span>
#include <vector>

#include "hicache/copier.hpp"
#include "hicache/page_layout.hpp"
#include "segment_table.hpp"

namespace hicache::cuda {

/// The shape of a lane's windows for one layout.
struct StagingPlan {
  const SegmentTable&
      table;  // the copier's, for whole pages: a window holds pages as host slots do
  std::size_t page_bytes = 0;
  std::size_t first_pages = 1;  // the largest first window of a call
  std::size_t most_pages = 1;   // a window's room: windows grow to this within a call
  std::size_t window_bytes = 0;

  /// @param window_most bytes a window may hold (staging_bytes / 2): most_pages pages, at least
  ///        one whatever it says. A call's first window holds kWindowPages pages at most, within
  ///        [kWindowLeast, window_most].
  /// @param table must outlive the plan.
  StagingPlan(const PageLayout& layout, std::size_t window_most, const SegmentTable& table);

  /// Each window costs the calling thread a handful of CUDA calls (~6 us beyond its DMA pieces,
  /// docs/performance.md): windows of several pages keep a call's CPU work down and let a
  /// store and a load overlap. Measured on an H200 over engines' pools (16-64-token blocks),
  /// 32 MiB windows against 8 MiB: pages of 4-8 MiB 11.3-11.5 -> 3.3-3.4 us a page, both
  /// directions at once 0.85-0.94 -> 0.98-1.00; pages under 1.3 MiB stored at 0.87-0.94 with
  /// 25-50 pages in every window against 0.94-0.97 with 8 MiB (the first window's gather waits
  /// longer before the link starts). So a call starts small and each window after the first
  /// holds twice the one before, up to most_pages (StagingLane::copy).
  static constexpr std::size_t kWindowPages = 16;
  /// A call of fewer pages than this many windows hold is cut into this many windows at least
  /// (pipelining; see StagingLane::copy).
  static constexpr std::size_t kCallWindows = 8;
  static constexpr std::size_t kWindowLeast = std::size_t{8} << 20;
};

class StagingLane {
 public:
  static constexpr int kWindows = 2;

  /// Allocates kWindows windows of plan.window_bytes on the current device and a DMA stream.
  /// @throws hicache::Error if the device memory cannot be had.
  explicit StagingLane(const StagingPlan& plan);
  ~StagingLane();
  StagingLane(const StagingLane&) = delete;
  StagingLane& operator=(const StagingLane&) = delete;

  /// Enqueues the copy of `moves` (hosts are the pages' host slots). Thread-safe.
  /// @throws hicache::Error if a CUDA call fails.
  void copy(Direction dir, std::span<const PageMove> moves, int max_blocks, cudaStream_t caller);

 private:
  void dma(Direction dir, std::span<const PageMove> moves, char* window);

  const StagingPlan& plan_;
  std::mutex mu_;
  char* buffer_ = nullptr;
  int next_ = 0;
  int last_dma_ = -1;              // the window whose DMA was enqueued last
  std::size_t ramp_ = 1;           // the next window's pages when a call continues the last one's
  cudaStream_t stream_ = nullptr;  // DMA
  std::array<cudaEvent_t, kWindows> dma_done_{};     // per window: its last DMA
  std::array<cudaEvent_t, kWindows> kernel_done_{};  // per window: its last gather or scatter
  std::vector<PageMove> ordered_;                    // scratch: a window's moves by host address
  std::vector<PageMove> staged_;                     // scratch: moves rewritten to window addresses
  std::vector<void*> src_, dst_;                     // scratch: DMA pieces
  std::vector<std::size_t> sizes_;
};

}  // namespace hicache::cuda
