#pragma once
// The gather/scatter kernel: copies a batch of pages between the engine's segments (device
// memory) and host slots (pinned, mapped memory addressed through UVA), in one launch.
//
// Work is cut into tiles of blockDim.x vectors; a page's tiles are its segments' tiles in order
// (segment s starts at tile first_tile[s] of the page). Each CTA takes U consecutive tiles at a
// time and issues all U loads before the first store, so U vectors per thread are in flight:
// reads across PCIe are latency-bound, and a few CTAs with several loads each saturate the link
// while leaving the SMs to the model.

#include <cstdint>

namespace hicache::cuda {

struct SegmentDesc {
  char* base;             // device address of block 0
  long long stride;       // bytes from one block to the next
  long long bytes;        // bytes of one block
  long long host_offset;  // where the segment's bytes start in a host page
  long long first_tile;   // tiles of the earlier segments, within one page
};

constexpr int kMaxSegments = 1024;
constexpr int kMaxMovesPerLaunch = 224;  // keeps the parameter block under 4 KiB

/// A launch's pages, passed by value in the kernel's parameter block.
template <int N>
struct MoveBatchOf {
  static constexpr int kCapacity = N;
  int count;
  long long blocks[N];
  char* hosts[N];
};
using MoveBatch = MoveBatchOf<kMaxMovesPerLaunch>;

// Vectors in flight per thread. Reads across PCIe (to device) are latency-bound and want many;
// reads from HBM (to host) need fewer, and 16-byte vectors at 8 deep would spill registers
// under the 64-register budget of 1024-thread CTAs.
template <typename V, bool kToHost>
constexpr int kUnroll = (sizeof(V) == 16 && kToHost) ? 4 : 8;

/// CTAs for a launch of `pages` pages: at most `max_ctas`, and no more than one per four tiles.
constexpr int launch_ctas(int pages, long long tiles_per_page, int max_ctas) {
  const long long work = (static_cast<long long>(pages) * tiles_per_page + 3) / 4;
  return static_cast<int>(work < max_ctas ? work : max_ctas);
}

template <typename V>
__device__ __forceinline__ V load_streaming(const V* p) {
  return __ldcs(p);
}
template <>
__device__ __forceinline__ unsigned char load_streaming(const unsigned char* p) {
  return *p;
}

template <typename V, int U, bool kToHost, class Batch = MoveBatch>
__global__ void __launch_bounds__(1024)
    page_copy_kernel(const SegmentDesc* __restrict__ segs, int nseg, long long tiles_per_page,
                     Batch batch) {
  __shared__ long long first_tile[kMaxSegments];
  for (int i = threadIdx.x; i < nseg; i += blockDim.x) first_tile[i] = segs[i].first_tile;
  __syncthreads();

  const long long total = static_cast<long long>(batch.count) * tiles_per_page;
  const long long tile_bytes = static_cast<long long>(blockDim.x) * sizeof(V);
  const long long lane_offset = static_cast<long long>(threadIdx.x) * sizeof(V);
  for (long long t0 = static_cast<long long>(blockIdx.x) * U; t0 < total;
       t0 += static_cast<long long>(gridDim.x) * U) {
    V v[U];
    V* dst[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      dst[u] = nullptr;
      const long long t = t0 + u;
      if (t >= total) continue;
      const long long m = t / tiles_per_page;
      const long long r = t - m * tiles_per_page;
      int lo = 0, hi = nseg - 1;  // last segment whose first tile is <= r
      while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (first_tile[mid] <= r) {
          lo = mid;
        } else {
          hi = mid - 1;
        }
      }
      const SegmentDesc& sd = segs[lo];
      const long long off = (r - first_tile[lo]) * tile_bytes + lane_offset;
      if (off >= sd.bytes) continue;  // the tail of a segment's last tile
      char* dev = sd.base + batch.blocks[m] * sd.stride + off;
      char* host = batch.hosts[m] + sd.host_offset + off;
      if constexpr (kToHost) {
        v[u] = load_streaming(reinterpret_cast<const V*>(dev));
        dst[u] = reinterpret_cast<V*>(host);
      } else {
        v[u] = load_streaming(reinterpret_cast<const V*>(host));
        dst[u] = reinterpret_cast<V*>(dev);
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (dst[u] != nullptr) *dst[u] = v[u];
    }
  }
}

}  // namespace hicache::cuda
