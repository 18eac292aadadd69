#pragma once
// Anonymous memory at a 2 MiB boundary, asking for transparent huge pages (internal: the host
// pool's allocators, host_pool.cpp and cpp/cuda/pinned_allocator.cu).
//
// Why: where the kernel gives huge pages only to memory that asks (THP "madvise", the usual
// default), aligned_alloc's 4 KiB pages made every pass over the pool pay a TLB miss each 4 KiB.
// Pinning such memory took twice as long (an H200 host, 8 GiB: 11.6-12.9 GB/s with 4 KiB pages,
// 18-25 with huge pages), and the Mooncake client's TCP transfers in and out of it ran 5-12 %
// slower than out of numpy arrays (which numpy maps on huge pages): docs/performance.md. Where
// the kernel keeps THP off, madvise is refused or ignored and the memory has 4 KiB pages.

#include <cstddef>

namespace hicache::detail {

inline constexpr std::size_t kHugePage = std::size_t{2} << 20;

/// `bytes` of zeroed memory at a kHugePage boundary, huge pages asked for.
/// @throws hicache::Error if the mapping fails.
void* map_huge_aligned(std::size_t bytes);
/// Gives back what map_huge_aligned(bytes) returned.
void unmap_huge_aligned(void* p, std::size_t bytes) noexcept;

}  // namespace hicache::detail
