// Where the CPU copier should start streaming: a call of S bytes in 256 KiB pages copied with
// memcpy page by page or with copy_streaming (non-temporal stores) page by page, then the
// destination read back once, as an engine reads KV a load just wrote. Streamed, the copy skips
// reading each destination line first, but the engine's read then comes from memory, not from
// the caches; the CPU copier streams calls of detail::kStreamingCallBytes and more.
//
//   build/<dir>/hicache_bench_stream_threshold [--reps 41]
//
// Prints, for each call size and each way, the median copy time, read time and their sum (us).
// Buffers rotate over a 1 GiB arena, 64 MiB apart, so no repetition finds the last one's lines
// in the caches. Built with -DHICACHE_BUILD_BENCH=ON (no CUDA needed).
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

#include "probe_args.hpp"
#include "stream_copy.hpp"

int main(int argc, char** argv) {
  const long reps = probe::arg(argc, argv, "--reps", 41L);
  if (reps < 1) {
    std::fprintf(stderr, "--reps must be >= 1\n");
    return 2;
  }
  using clock = std::chrono::steady_clock;
  const std::size_t arena = std::size_t{1} << 30, page = std::size_t{256} << 10;
  std::vector<std::byte> src(arena), dst(arena);
  std::memset(src.data(), 1, arena);
  std::memset(dst.data(), 2, arena);
  std::uint64_t sink = 0;
  std::printf(
      "| MiB a call | memcpy: copy / read / both (us) | streamed: copy / read / both (us) |\n");
  std::printf("| --- | --- | --- |\n");
  for (std::size_t mib : {1, 2, 4, 8, 16, 32, 64}) {
    const std::size_t bytes = mib << 20;
    double copy[2], read[2];
    for (int streamed = 0; streamed < 2; ++streamed) {
      std::vector<double> tc, tr;
      std::size_t off = 0;
      for (long r = 0; r < reps; ++r) {
        if (off + bytes > arena) off = 0;
        std::byte* d = dst.data() + off;
        const std::byte* s = src.data() + off;
        off += bytes + (std::size_t{64} << 20);
        const auto t0 = clock::now();
        for (std::size_t p = 0; p < bytes; p += page) {
          if (streamed) {
            hicache::detail::copy_streaming(d + p, s + p, page);
          } else {
            std::memcpy(d + p, s + p, page);
          }
        }
        const auto t1 = clock::now();
        const auto* q = reinterpret_cast<const std::uint64_t*>(d);
        for (std::size_t i = 0; i < bytes / 8; i += 8) sink += q[i] ^ q[i + 3] ^ q[i + 7];
        const auto t2 = clock::now();
        tc.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
        tr.push_back(std::chrono::duration<double, std::micro>(t2 - t1).count());
      }
      std::sort(tc.begin(), tc.end());
      std::sort(tr.begin(), tr.end());
      copy[streamed] = tc[tc.size() / 2];
      read[streamed] = tr[tr.size() / 2];
    }
    std::printf("| %zu | %.0f / %.0f / %.0f | %.0f / %.0f / %.0f |\n", mib, copy[0], read[0],
                copy[0] + read[0], copy[1], read[1], copy[1] + read[1]);
  }
  return sink == 42 ? 1 : 0;  // keeps the reads
}
