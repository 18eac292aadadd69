#include <algorithm>
#include <functional>

#include "cuda_check.cuh"
#include "dma_batch.hpp"
#include "staging_lane.hpp"

namespace hicache::cuda {

StagingPlan::StagingPlan(const PageLayout& layout, std::size_t window_most,
                         const SegmentTable& table)
    : table(table), page_bytes(layout.page_bytes()) {
  const std::size_t first = std::min(
      window_most, std::max(kWindowLeast, kWindowPages * static_cast<std::size_t>(page_bytes)));
  first_pages = std::max<std::size_t>(1, first / page_bytes);
  most_pages = std::max(first_pages, window_most / page_bytes);
  window_bytes = (most_pages * page_bytes + 255) / 256 * 256;
}

StagingLane::StagingLane(const StagingPlan& plan) : plan_(plan) {
  HICACHE_CUDA_CHECK(cudaMalloc(&buffer_, plan.window_bytes * kWindows));
  try {
    // Non-blocking: the legacy default stream must not serialize with our DMA.
    HICACHE_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    for (int w = 0; w < kWindows; ++w) {
      HICACHE_CUDA_CHECK(cudaEventCreateWithFlags(&dma_done_[w], cudaEventDisableTiming));
      HICACHE_CUDA_CHECK(cudaEventCreateWithFlags(&kernel_done_[w], cudaEventDisableTiming));
    }
  } catch (...) {
    for (int w = 0; w < kWindows; ++w) {
      if (dma_done_[w] != nullptr) cudaEventDestroy(dma_done_[w]);
      if (kernel_done_[w] != nullptr) cudaEventDestroy(kernel_done_[w]);
    }
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
    cudaFree(buffer_);
    throw;
  }
}

StagingLane::~StagingLane() {
  cudaStreamSynchronize(stream_);
  for (int w = 0; w < kWindows; ++w) {
    cudaEventDestroy(dma_done_[w]);
    cudaEventDestroy(kernel_done_[w]);
  }
  cudaStreamDestroy(stream_);
  cudaFree(buffer_);
}

void StagingLane::dma(Direction dir, std::span<const PageMove> moves, char* window) {
  src_.clear();
  dst_.clear();
  sizes_.clear();
  const std::size_t bytes = plan_.page_bytes;
  for (std::size_t i = 0; i < moves.size(); ++i) {
    char* host = reinterpret_cast<char*>(moves[i].host);
    char* stage = window + i * bytes;
    // Host slots that follow each other in memory become one piece. Such slots lie in one pool
    // chunk (HostPool::kChunkGap), so the piece stays within one pinned allocation.
    const bool joins =
        !sizes_.empty() &&
        static_cast<char*>(dir == Direction::kToHost ? dst_.back() : src_.back()) + sizes_.back() ==
            host;
    if (joins) {
      sizes_.back() += bytes;
      continue;
    }
    src_.push_back(dir == Direction::kToHost ? static_cast<void*>(stage) : host);
    dst_.push_back(dir == Direction::kToHost ? static_cast<void*>(host) : stage);
    sizes_.push_back(bytes);
  }
  copy_batch(dst_.data(), src_.data(), sizes_.data(), sizes_.size(), stream_);
}

void StagingLane::copy(Direction dir, std::span<const PageMove> moves, int max_blocks,
                       cudaStream_t caller) {
  std::lock_guard<std::mutex> guard(mu_);
  // A call of few pages still goes in kCallWindows windows, so that its DMA and its
  // gathers/scatters overlap (a 16-page call of 4 MiB pages in two windows ran at 0.66). Each
  // window after the first holds twice the one before, up to the window's room: the link is busy
  // with the window before, and fewer windows cost fewer CUDA calls. A call that finds this
  // lane's last DMA still running (a store's next installment) goes on growing from there. A
  // load's last windows shrink again: its last scatter runs after the link is done.
  const std::size_t small = std::clamp<std::size_t>(
      (moves.size() + StagingPlan::kCallWindows - 1) / StagingPlan::kCallWindows, 1,
      plan_.first_pages);
  const bool busy = last_dma_ >= 0 && cudaEventQuery(dma_done_[last_dma_]) == cudaErrorNotReady;
  std::size_t grow = busy ? std::max(small, ramp_) : small;
  int last = -1;
  for (std::size_t i0 = 0, step = 0; i0 < moves.size(); i0 += step) {
    const std::size_t left = moves.size() - i0;
    step = std::min(grow, left);
    if (dir == Direction::kToDevice) step = std::min(step, std::max(small, (left + 1) / 2));
    grow = std::min(plan_.most_pages, 2 * grow);
    // A window's pages go in host-address order: a store into a full pool takes the slots its
    // eviction freed, an old chain's leaf first, so its pages' slots are adjacent but may run
    // backwards; in order, they join into one DMA piece (each piece costs ~0.4 us of CPU,
    // bench/research/window_calls.cu).
    ordered_.assign(moves.begin() + static_cast<std::ptrdiff_t>(i0),
                    moves.begin() + static_cast<std::ptrdiff_t>(i0 + step));
    std::sort(ordered_.begin(), ordered_.end(),
              [](const PageMove& a, const PageMove& b) { return std::less<>{}(a.host, b.host); });
    const std::span<const PageMove> pages = ordered_;
    const int w = next_;
    next_ = (next_ + 1) % kWindows;
    last = w;
    char* window = buffer_ + static_cast<std::size_t>(w) * plan_.window_bytes;
    staged_.clear();
    for (std::size_t i = 0; i < pages.size(); ++i) {
      staged_.push_back(
          {pages[i].block, reinterpret_cast<std::byte*>(window + i * plan_.page_bytes)});
    }
    if (dir == Direction::kToDevice) {
      HICACHE_CUDA_CHECK(cudaStreamWaitEvent(stream_, kernel_done_[w], 0));  // window free
      dma(dir, pages, window);
      HICACHE_CUDA_CHECK(cudaEventRecord(dma_done_[w], stream_));
      HICACHE_CUDA_CHECK(cudaStreamWaitEvent(caller, dma_done_[w], 0));
      plan_.table.launch(dir, staged_, max_blocks, caller);
      HICACHE_CUDA_CHECK(cudaEventRecord(kernel_done_[w], caller));
    } else {
      HICACHE_CUDA_CHECK(cudaStreamWaitEvent(caller, dma_done_[w], 0));  // window free
      plan_.table.launch(dir, staged_, max_blocks, caller);
      HICACHE_CUDA_CHECK(cudaEventRecord(kernel_done_[w], caller));
      HICACHE_CUDA_CHECK(cudaStreamWaitEvent(stream_, kernel_done_[w], 0));
      dma(dir, pages, window);
      HICACHE_CUDA_CHECK(cudaEventRecord(dma_done_[w], stream_));
    }
  }
  ramp_ = grow;
  if (last >= 0) last_dma_ = last;
  // A store is done when its last DMA is: the DMA stream runs in order, so the last one covers
  // the earlier ones, and a fence on the caller's stream after this wait covers them all.
  if (dir == Direction::kToHost && last >= 0) {
    HICACHE_CUDA_CHECK(cudaStreamWaitEvent(caller, dma_done_[last], 0));
  }
}

}  // namespace hicache::cuda
