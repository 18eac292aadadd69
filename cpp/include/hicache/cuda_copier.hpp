#pragma once
// The CUDA copier, behind a CUDA-free interface: engines include this without CUDA headers.
// In a build without CUDA, cuda_available() is false and make_cuda_copier throws.

#include <cstddef>
#include <memory>
#include <stdexcept>
#include <string>

#include "hicache/copier.hpp"

namespace hicache {

/// How pages cross PCIe (see cuda_copier.cu for the measurements behind the automatic choice).
enum class CopyPath {
  kAuto,    ///< chosen at bind() from the layout
  kDma,     ///< every chunk on the DMA engines, one cudaMemcpyBatchAsync a batch
  kStaged,  ///< whole host pages on the DMA engines through device staging windows, then a
            ///< gather/scatter kernel between the windows and the engine's blocks at HBM speed
  kKernel,  ///< a gather/scatter kernel reading or writing host memory through UVA pointers
};

struct CudaCopierOptions {
  /// Which path copies take; kAuto picks one from the layout at bind().
  CopyPath path = CopyPath::kAuto;
  /// CTAs of the gather/scatter kernel across PCIe; a few saturate PCIe and leave the SMs to the
  /// model. The staged path's scatters within the GPU take one CTA per SM, or this many if more.
  int max_blocks = 4;
  /// Threads per CTA.
  int threads = 1024;
  /// Staged path: device memory per (stream, direction) at most, cut into two windows of up to
  /// staging_bytes / 2, at least one whole page each; a call's first window holds 16 pages
  /// within [8 MiB, staging_bytes / 2], each later one twice the one before (StagingPlan).
  /// Each stream that stores or loads gets its own staging (up to 4 streams a direction, then
  /// they share), allocated at its first use. 0 disables staging (kAuto then never picks it).
  std::size_t staging_bytes = std::size_t{64} << 20;

  /// @throws std::invalid_argument naming the option (by its Python name) if one is out of range.
  void validate() const {
    auto fail = [](const char* what, long long v) {
      throw std::invalid_argument(std::string(what) + ", not " + std::to_string(v));
    };
    if (max_blocks < 1 || max_blocks > 1024) {
      fail("cuda_blocks must be in [1, 1024] (max_blocks)", max_blocks);
    }
    if (threads < 32 || threads > 1024 || threads % 32 != 0) {
      fail("CUDA copier threads must be a multiple of 32 in [32, 1024]", threads);
    }
    if (path == CopyPath::kStaged && staging_bytes == 0) {
      throw std::invalid_argument("cuda_path='staged' needs cuda_staging_bytes > 0");
    }
  }
};

/// Whether this build has the CUDA copier and a CUDA device is visible.
bool cuda_available();

/// @throws std::invalid_argument if this build has no CUDA, the device does not exist, or an
///         option is out of range (CudaCopierOptions::validate).
std::shared_ptr<Copier> make_cuda_copier(int device, CudaCopierOptions options = {});

/// Memory from `inner` (e.g. make_shared_region_allocator) registered with CUDA
/// (cudaHostRegister, portable and mapped) so the CUDA copier can DMA from it and address it.
/// @throws std::invalid_argument in a build without CUDA.
std::shared_ptr<HostAllocator> make_cuda_registered_allocator(std::shared_ptr<HostAllocator> inner);

}  // namespace hicache
