#pragma once
// Pinned, mapped host memory for the CUDA copier's pools (internal to cpp/cuda).

#include <memory>

#include "hicache/host_pool.hpp"

namespace hicache::cuda {

enum class PinMode {
  kHostAlloc,  ///< cudaHostAlloc(portable | mapped): the driver allocates and pins
  kRegister,   ///< mmap, touch pages on several threads, then cudaHostRegister(portable | mapped)
};

/// Host memory that every device can address directly (UVA) and DMA from.
/// @param threads threads that pre-fault pages in kRegister mode (0: hardware concurrency).
std::shared_ptr<HostAllocator> make_pinned_allocator(PinMode mode = PinMode::kRegister,
                                                     int threads = 0);

/// `inner`'s memory, registered with CUDA after it is allocated (shared memory regions).
std::shared_ptr<HostAllocator> make_registered_view(std::shared_ptr<HostAllocator> inner);

}  // namespace hicache::cuda
