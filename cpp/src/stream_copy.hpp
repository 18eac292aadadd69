#pragma once
// copy_streaming (internal): the CPU copier's copy of large calls, with non-temporal stores.
//
// glibc's memcpy writes through the caches below a size near the last-level cache's share (tens
// of megabytes), so a page copied by itself, however many pages a call holds, reads each
// destination line before it writes it. A call that moves more than the caches hold gains
// nothing from those lines. On this project's 2-core machine, 256 MiB in 1 MiB pages on two
// threads: 9.6-10.2 GB/s one memcpy a page, 15.4 GB/s here (memcpy of the whole 128 MiB halves
// at once: 14.3-15.1).

#include <cstddef>

namespace hicache::detail {

/// Calls of the CPU copier that move at least this many bytes copy their pages with
/// copy_streaming; smaller ones, whose destinations the engine may read from the caches, with
/// memcpy. Counting the copy and the engine's read-back (bench/research/stream_threshold.cpp,
/// 2-core machine), the two ways are even at 1 MiB and streaming is ahead by 4-8 % at 2 MiB and
/// 5-20 % at 4 MiB; kept at 4 MiB until a host whose last-level cache keeps a few megabytes is
/// measured (docs/performance.md).
inline constexpr std::size_t kStreamingCallBytes = std::size_t{4} << 20;

/// Copies n bytes from src to dst (not overlapping) with non-temporal stores, the destination's
/// 4 KiB pages four at a time, and a store fence after them: what it wrote is visible to every
/// thread once it returns. memcpy where the CPU has no such stores.
void copy_streaming(std::byte* dst, const std::byte* src, std::size_t n);

/// The same with 16-byte stores only, as a CPU without AVX2 runs it (for tests).
void copy_streaming_sse2(std::byte* dst, const std::byte* src, std::size_t n);

}  // namespace hicache::detail
