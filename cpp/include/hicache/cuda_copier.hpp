#pragma once
// The CUDA copier, behind a CUDA-free interface: engines include this without CUDA headers.
// In a build without CUDA, cuda_available() is false and make_cuda_copier throws.

#include <cstddef>
#include <memory>
#include <stdexcept>
#include <string>

#include "hicache/copier.hpp"

namespace hicache {

struct CudaCopierOptions {
  /// CTAs of the gather/scatter kernel; a few saturate PCIe and leave the SMs to the model.
  int max_blocks = 4;
  /// Threads per CTA.
  int threads = 1024;
  /// When every segment's block is at least this large, pages move on the DMA engines
  /// (cudaMemcpyBatchAsync) instead of the kernel: measured on an H200, DMA reaches 0.99 of the
  /// contiguous rate on 4.4 MB chunks where the kernel reaches 0.92-0.94, but only 0.91 on
  /// 256 KiB chunks and 0.07-0.54 on 16 KiB ones. 0 disables DMA.
  std::size_t dma_min_chunk_bytes = std::size_t{1} << 20;
  /// Device memory, per direction, through which pages with smaller chunks cross PCIe: each
  /// host page moves whole on the DMA engines into one of `staging_windows` windows that share
  /// this size, and the kernel scatters it to the engine's blocks at HBM speed (or gathers, for
  /// stores). Each stream that stores or loads gets its own staging (up to 4 streams a direction,
  /// then they share), allocated at its first use: the copier holds staging_bytes of device
  /// memory per (stream, direction) in use. 0: no staging, the kernel copies across PCIe.
  std::size_t staging_bytes = std::size_t{16} << 20;
  /// Pages smaller than this are not staged: the DMA engines lose to the kernel on small pieces
  /// (host slots are not adjacent in general, so each page is one DMA piece).
  std::size_t staging_min_page_bytes = std::size_t{512} << 10;
  /// Windows the staging is cut into (2 to 64): more let the DMA engines run further ahead of
  /// gathers/scatters that wait for SMs. Measured on an H200 (BENCHMARKS.md): 8 windows are no
  /// faster beside a bf16 matmul and 2-5 % slower alone, so 2 stays the default.
  int staging_windows = 2;
  /// Run the gathers/scatters on a greatest-priority stream of the copier's own (ordered after
  /// the caller's earlier work by an event) instead of the caller's stream, so that beside
  /// compute their CTAs go first as SMs free up. Measured on an H200 (BENCHMARKS.md): no faster
  /// beside a bf16 matmul (27.6 / 30.7 GB/s against 27.4 / 30.8), hence off by default.
  bool staging_priority = false;

  /// @throws std::invalid_argument naming the option (by its Python name) if one is out of range.
  void validate() const {
    auto fail = [](const char* what, long long v) {
      throw std::invalid_argument(std::string(what) + ", not " + std::to_string(v));
    };
    if (max_blocks < 1 || max_blocks > 1024) {
      fail("cuda_blocks must be in [1, 1024] (max_blocks)", max_blocks);
    }
    if (staging_windows < 2 || staging_windows > 64) {
      fail("cuda_staging_windows must be in [2, 64] (staging_windows)", staging_windows);
    }
    if (threads < 32 || threads > 1024 || threads % 32 != 0) {
      fail("CUDA copier threads must be a multiple of 32 in [32, 1024]", threads);
    }
  }
};

/// Whether this build has the CUDA copier and a CUDA device is visible.
bool cuda_available();

/// @throws std::invalid_argument if this build has no CUDA, the device does not exist, or an
///         option is out of range (CudaCopierOptions::validate).
std::shared_ptr<Copier> make_cuda_copier(int device, CudaCopierOptions options = {});

}  // namespace hicache
