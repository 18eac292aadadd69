#include <cstdlib>
#include <cstring>

#include "cuda_check.cuh"
#include "dma_batch.hpp"

namespace hicache::cuda {
namespace {

bool batch_api_enabled() {
  static const bool enabled = [] {
    const char* v = std::getenv("HICACHE_CUDA_BATCH_DMA");
    return v == nullptr || std::strcmp(v, "0") != 0;
  }();
  return enabled;
}

}  // namespace

void copy_batch(void** dst, void** src, std::size_t* sizes, std::size_t n, cudaStream_t stream) {
  if (n == 0) return;  // nothing to submit (and a count of 0 is not worth asking the API about)
  if (n == 1 || !batch_api_enabled()) {
    for (std::size_t i = 0; i < n; ++i) {
      HICACHE_CUDA_CHECK(cudaMemcpyAsync(dst[i], src[i], sizes[i], cudaMemcpyDefault, stream));
    }
    return;
  }
  cudaMemcpyAttributes attr{};
  attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
  std::size_t attr_index = 0;
  HICACHE_CUDA_CHECK(cudaMemcpyBatchAsync(dst, src, sizes, n, &attr, &attr_index, 1, stream));
}

}  // namespace hicache::cuda
