#include <algorithm>

#include "cuda_check.cuh"
#include "dma_batch.hpp"
#include "staging_lane.hpp"

namespace hicache::cuda {

StagingPlan::StagingPlan(const PageLayout& layout, std::size_t window_target, int vec,
                         int threads) {
  const auto& segs = layout.segments();
  std::vector<std::pair<std::size_t, std::size_t>> ranges;  // [first, end) segments per group
  std::size_t first = 0, bytes = 0;
  for (std::size_t s = 0; s < segs.size(); ++s) {
    const auto b = static_cast<std::size_t>(segs[s].block_bytes);
    if (s > first && bytes + b > window_target) {
      ranges.emplace_back(first, s);
      first = s;
      bytes = 0;
    }
    bytes += b;
  }
  ranges.emplace_back(first, segs.size());
  for (auto [lo, hi] : ranges) {
    Group g;
    g.host_offset = layout.page_offset(lo);
    for (std::size_t s = lo; s < hi; ++s) g.bytes += static_cast<std::size_t>(segs[s].block_bytes);
    g.table = std::make_unique<SegmentTable>(segment_rows(layout, lo, hi), vec, threads);
    window_bytes = std::max(window_bytes, g.bytes);
    groups.push_back(std::move(g));
  }
  if (groups.size() == 1) {
    pages_per_window = std::max<std::size_t>(1, window_target / groups[0].bytes);
    window_bytes = pages_per_window * groups[0].bytes;
  }
  window_bytes = (window_bytes + 255) / 256 * 256;
}

StagingLane::StagingLane(const StagingPlan& plan, int windows, bool priority_kernels)
    : plan_(plan), windows_(windows) {
  HICACHE_CUDA_CHECK(cudaMalloc(&buffer_, plan.window_bytes * static_cast<std::size_t>(windows)));
  try {
    // Non-blocking: the legacy default stream must not serialize with our DMA.
    HICACHE_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    if (priority_kernels) {
      int least = 0, greatest = 0;
      HICACHE_CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&least, &greatest));
      HICACHE_CUDA_CHECK(cudaStreamCreateWithPriority(&kernels_, cudaStreamNonBlocking, greatest));
      HICACHE_CUDA_CHECK(cudaEventCreateWithFlags(&caller_ready_, cudaEventDisableTiming));
    }
    for (int w = 0; w < windows; ++w) {
      for (auto* list : {&dma_done_, &kernel_done_}) {
        cudaEvent_t e;
        HICACHE_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
        list->push_back(e);
      }
    }
  } catch (...) {
    for (auto* list : {&dma_done_, &kernel_done_})
      for (cudaEvent_t e : *list) cudaEventDestroy(e);
    if (caller_ready_ != nullptr) cudaEventDestroy(caller_ready_);
    if (kernels_ != nullptr) cudaStreamDestroy(kernels_);
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
    cudaFree(buffer_);
    throw;
  }
}

StagingLane::~StagingLane() {
  cudaStreamSynchronize(stream_);
  if (kernels_ != nullptr) cudaStreamSynchronize(kernels_);
  for (auto* list : {&dma_done_, &kernel_done_})
    for (cudaEvent_t e : *list) cudaEventDestroy(e);
  if (caller_ready_ != nullptr) cudaEventDestroy(caller_ready_);
  if (kernels_ != nullptr) cudaStreamDestroy(kernels_);
  cudaStreamDestroy(stream_);
  cudaFree(buffer_);
}

void StagingLane::dma(Direction dir, std::span<const PageMove> moves, const StagingPlan::Group& g,
                      char* window) {
  src_.clear();
  dst_.clear();
  sizes_.clear();
  for (std::size_t i = 0; i < moves.size(); ++i) {
    char* host = reinterpret_cast<char*>(moves[i].host) + g.host_offset;
    char* stage = window + i * g.bytes;
    // Host slots that follow each other in memory become one piece.
    const bool joins =
        !sizes_.empty() &&
        static_cast<char*>(dir == Direction::kToHost ? dst_.back() : src_.back()) + sizes_.back() ==
            host;
    if (joins) {
      sizes_.back() += g.bytes;
      continue;
    }
    src_.push_back(dir == Direction::kToHost ? static_cast<void*>(stage) : host);
    dst_.push_back(dir == Direction::kToHost ? static_cast<void*>(host) : stage);
    sizes_.push_back(g.bytes);
  }
  copy_batch(dst_.data(), src_.data(), sizes_.data(), sizes_.size(), stream_);
}

void StagingLane::copy(Direction dir, std::span<const PageMove> moves, int max_blocks,
                       cudaStream_t caller) {
  std::lock_guard<std::mutex> guard(mu_);
  // Where the gathers/scatters run: the caller's stream, or ours after the caller's earlier work.
  cudaStream_t ks = caller;
  if (kernels_ != nullptr) {
    HICACHE_CUDA_CHECK(cudaEventRecord(caller_ready_, caller));
    HICACHE_CUDA_CHECK(cudaStreamWaitEvent(kernels_, caller_ready_, 0));
    ks = kernels_;
  }
  const bool one_group = plan_.groups.size() == 1;
  const std::size_t step = one_group ? plan_.pages_per_window : 1;
  int last = -1;
  for (std::size_t i0 = 0; i0 < moves.size(); i0 += step) {
    const std::size_t i1 = std::min(moves.size(), i0 + step);
    for (const StagingPlan::Group& g : plan_.groups) {
      const int w = next_;
      next_ = (next_ + 1) % windows_;
      last = w;
      char* window = buffer_ + static_cast<std::size_t>(w) * plan_.window_bytes;
      const auto pages = moves.subspan(i0, i1 - i0);
      staged_.clear();
      for (std::size_t i = 0; i < pages.size(); ++i) {
        staged_.push_back({pages[i].block, reinterpret_cast<std::byte*>(window + i * g.bytes)});
      }
      if (dir == Direction::kToDevice) {
        HICACHE_CUDA_CHECK(cudaStreamWaitEvent(stream_, kernel_done_[w], 0));  // window free
        dma(dir, pages, g, window);
        HICACHE_CUDA_CHECK(cudaEventRecord(dma_done_[w], stream_));
        HICACHE_CUDA_CHECK(cudaStreamWaitEvent(ks, dma_done_[w], 0));
        g.table->launch(dir, staged_, max_blocks, ks);
        HICACHE_CUDA_CHECK(cudaEventRecord(kernel_done_[w], ks));
      } else {
        HICACHE_CUDA_CHECK(cudaStreamWaitEvent(ks, dma_done_[w], 0));  // window free
        g.table->launch(dir, staged_, max_blocks, ks);
        HICACHE_CUDA_CHECK(cudaEventRecord(kernel_done_[w], ks));
        HICACHE_CUDA_CHECK(cudaStreamWaitEvent(stream_, kernel_done_[w], 0));
        dma(dir, pages, g, window);
        HICACHE_CUDA_CHECK(cudaEventRecord(dma_done_[w], stream_));
      }
    }
  }
  // A store is done when its last DMA is: the DMA stream runs in order, so the last one covers
  // the earlier ones, and a fence on the caller's stream after this wait covers them all.
  if (dir == Direction::kToHost && last >= 0) {
    HICACHE_CUDA_CHECK(cudaStreamWaitEvent(caller, dma_done_[last], 0));
  }
  // A load on our stream: the caller waits for its last scatter (our stream runs in order).
  if (dir == Direction::kToDevice && last >= 0 && ks != caller) {
    HICACHE_CUDA_CHECK(cudaStreamWaitEvent(caller, kernel_done_[last], 0));
  }
}

}  // namespace hicache::cuda
