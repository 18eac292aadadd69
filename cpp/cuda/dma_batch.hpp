#pragma once
// One submission of several DMA copies (internal to cpp/cuda).
//
// cudaMemcpyBatchAsync by default. HICACHE_CUDA_BATCH_DMA=0 in the environment makes it one
// cudaMemcpyAsync per piece instead: slower on small pieces, but compute-sanitizer's initcheck
// (CUDA 13.0) does not see the device writes of cudaMemcpyBatchAsync and reports every kernel
// read of them as uninitialized (shown on an H200 with a two-piece probe whose sum came out
// right), so the GPU sanitizer run sets it for initcheck.

#include <cuda_runtime.h>

#include <cstddef>

namespace hicache::cuda {

/// Enqueues dst[i] <- src[i] (sizes[i] bytes) for i < n on `stream`, in stream order.
/// @throws hicache::Error if the copies cannot be enqueued.
void copy_batch(void** dst, void** src, std::size_t* sizes, std::size_t n, cudaStream_t stream);

}  // namespace hicache::cuda
