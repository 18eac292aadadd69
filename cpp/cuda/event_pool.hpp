#pragma once
// A pool of CUDA events (internal to cpp/cuda): fences, timers and the copies' fork and join
// points take one and give it back: creating one per transfer costs more than the transfer's
// bookkeeping.

#include <cuda_runtime.h>

#include <mutex>
#include <vector>

#include "cuda_check.cuh"

namespace hicache::cuda {

class EventPool {
 public:
  explicit EventPool(unsigned flags = cudaEventDisableTiming) : flags_(flags) {}
  ~EventPool() {
    for (cudaEvent_t e : free_) cudaEventDestroy(e);
  }
  /// @throws hicache::Error if no event can be created.
  cudaEvent_t take() {
    cudaEvent_t e = reuse();
    if (e == nullptr) HICACHE_CUDA_CHECK(cudaEventCreateWithFlags(&e, flags_));
    return e;
  }
  /// nullptr if no event can be created (for bookkeeping that may go without).
  cudaEvent_t try_take() noexcept {
    cudaEvent_t e = reuse();
    if (e == nullptr && cudaEventCreateWithFlags(&e, flags_) != cudaSuccess) {
      cudaGetLastError();
      return nullptr;
    }
    return e;
  }
  void give(cudaEvent_t e) {
    std::lock_guard<std::mutex> g(mu_);
    free_.push_back(e);
  }
  /// Work enqueued on `to` from now on runs after the work enqueued on `from` so far: an event
  /// recorded on `from` that `to` waits for, given back at once (a wait takes the event as last
  /// recorded). @throws hicache::Error if a CUDA call fails.
  void order(cudaStream_t from, cudaStream_t to) {
    cudaEvent_t e = take();
    const cudaError_t rec = cudaEventRecord(e, from);
    const cudaError_t err = rec != cudaSuccess ? rec : cudaStreamWaitEvent(to, e, 0);
    give(e);
    if (err != cudaSuccess) {
      throw_cuda_error(err, rec != cudaSuccess ? "cudaEventRecord" : "cudaStreamWaitEvent",
                       __FILE__, __LINE__);
    }
  }

 private:
  cudaEvent_t reuse() {
    std::lock_guard<std::mutex> g(mu_);
    if (free_.empty()) return nullptr;
    cudaEvent_t e = free_.back();
    free_.pop_back();
    return e;
  }
  unsigned flags_;
  std::mutex mu_;
  std::vector<cudaEvent_t> free_;
};

}  // namespace hicache::cuda
