#pragma once
// The CUDA copier, behind a CUDA-free interface: engines include this without CUDA headers.
// In a build without CUDA, cuda_available() is false and make_cuda_copier throws.

#include <memory>

#include "hicache/copier.hpp"

namespace hicache {

struct CudaCopierOptions {
  /// CTAs of the gather/scatter kernel; a few saturate PCIe and leave the SMs to the model.
  int max_blocks = 4;
  /// Threads per CTA.
  int threads = 1024;
};

/// Whether this build has the CUDA copier and a CUDA device is visible.
bool cuda_available();

/// @throws std::invalid_argument if this build has no CUDA, or the device does not exist.
std::shared_ptr<Copier> make_cuda_copier(int device, CudaCopierOptions options = {});

}  // namespace hicache
