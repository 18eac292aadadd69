#pragma once
// Page checksums taken on the device: a store's beside its copy, a load's after it (internal to
// cpp/cuda).
//
// A cache with a tier writes each page to it with a record that carries the page's checksum
// (tier_record.hpp). The CPU copier sums a page as it copies it; the CUDA copier's copies never
// pass through the CPU, so the tier thread used to read every stored page back from its host
// slot and sum it before the first put could start: 1.2-2.0 ms of 16 cores for 64-256 MiB on an
// H100 host, 10-20 % of a put over Mooncake's TCP transport (docs/performance.md). The device reads
// the same bytes from the engine's blocks instead, while the store's copy runs: a kernel of a
// few CTAs on a stream of its own, forked from the store's stream before the copy and joined
// after it, so a fence recorded after the store covers the sums too.
//
// A page fetched from the tier is checked against its record's checksum by its first load. A
// load's sums run on its own stream after its copy, over the bytes as they landed, so the CPU
// need not read the page from its host slot beside the copy (the cache asks for them only where
// it can wait for the load: HostPrefixCache::unchecked_sums).
//
// A page's checksum is a chain over its kilobyte blocks (page_checksum_def.hpp), but what each
// block adds to the chain is a plain sum: a CTA sums a page, eight warps adding up its blocks 64
// at a time while a ninth runs the chain over the 64 before (device_sums.cu).

#include <cuda_runtime.h>

#include <cstddef>
#include <mutex>
#include <span>
#include <utility>
#include <vector>

#include "event_pool.hpp"
#include "hicache/copier.hpp"
#include "hicache/page_layout.hpp"
#include "page_copy_kernel.cuh"

namespace hicache::cuda {

class DeviceSums {
 public:
  /// Whether the device can sum pages of `layout`: every segment but the last whole kilobytes
  /// (the checksum's blocks, as the CPU copier asks), every base and stride 8-byte aligned.
  static bool can_sum(const PageLayout& layout);

  /// @param rows the layout's segments on the device (the copier's SegmentTable), which must
  ///        outlive this; `layout` one that can_sum.
  DeviceSums(const SegmentDesc* rows, int segments, const PageLayout& layout);
  ~DeviceSums();
  DeviceSums(const DeviceSums&) = delete;
  DeviceSums& operator=(const DeviceSums&) = delete;

  /// Enqueues the checksum of every move that has a sum_at_fence, after the work enqueued on `s`
  /// so far, on a stream of this object's. Returns the event `s` must wait for (join) once the
  /// copy is enqueued on it, or nullptr if no move asked for its sum.
  /// @throws hicache::Error if a CUDA call fails.
  cudaEvent_t fork(std::span<const PageMove> moves, cudaStream_t s);
  /// Makes `s` wait for the sums fork enqueued; gives the event back.
  void join(cudaEvent_t summed, cudaStream_t s);
  /// Enqueues the checksum of every move that has a sum_at_fence on `s` itself, after the work
  /// enqueued there so far: a load's, over the bytes as they landed in the engine's blocks.
  /// @throws hicache::Error if a CUDA call fails.
  void after(std::span<const PageMove> moves, cudaStream_t s);

  /// CUDA allows 4 KiB of kernel parameters: 16 bytes a page.
  static constexpr int kMaxPagesPerLaunch = 240;

 private:
  // Each caller's stream gets a stream of its own, up to kMaxSides (later ones share them), so
  // a store's sums never wait behind another stream's work.
  static constexpr std::size_t kMaxSides = 4;
  cudaStream_t side(cudaStream_t s);
  // Launches the sums of the moves that ask for them on `on`.
  void launch(std::span<const PageMove> moves, cudaStream_t on);

  const SegmentDesc* rows_;
  int segments_;
  std::size_t page_bytes_;
  long long whole_blocks_ = 0;  // the page's whole checksum blocks
  EventPool events_;
  std::mutex mu_;
  std::vector<std::pair<cudaStream_t, cudaStream_t>> sides_;  // caller's -> ours
};

}  // namespace hicache::cuda
