// What one DMA piece of cudaMemcpyBatchAsync costs the calling thread, by piece size, by the
// kind of pinned host memory (cudaHostAlloc, or mmap + cudaHostRegister in one region or in
// 64 MiB chunks, as a host pool pins them) and by direction: 1024 pieces between scattered host
// slots and a device buffer, in batches of 64, best of 5 rounds (the stream drained between
// rounds). Prints the submission time a piece and the time until the pieces are copied.
//
//   build/gpu/hicache_bench_piece_cost      (scripts/gpu_run.sh bench-lowlevel runs it)
#include <cuda_runtime.h>
#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <random>
#include <string_view>
#include <vector>

#include "exit_on_cuda_error.cuh"

namespace {
using Clock = std::chrono::steady_clock;
constexpr std::size_t kPieces = 1024, kBatch = 64, kSlots = 2048;
constexpr std::size_t kRegion = std::size_t{64} << 20;  // a pool chunk when registered in many

struct Host {
  std::vector<char*> bases;
  std::vector<std::size_t> sizes;
  bool registered = false;
  char* slot(std::size_t i, std::size_t piece) const {
    const std::size_t per = std::max<std::size_t>(1, sizes[0] / piece);
    return bases[i / per] + (i % per) * piece;
  }
};

Host make_host(const char* kind, std::size_t piece) {
  Host h;
  const std::size_t total = kSlots * piece;
  if (std::string_view(kind) == "cudaHostAlloc") {
    char* p = nullptr;
    check(cudaHostAlloc(reinterpret_cast<void**>(&p), total,
                        cudaHostAllocPortable | cudaHostAllocMapped),
          "cudaHostAlloc");
    h.bases = {p};
    h.sizes = {total};
    return h;
  }
  const std::size_t region =
      std::string_view(kind) == "register-one" ? total : std::max(kRegion, piece);
  h.registered = true;
  for (std::size_t off = 0; off < total; off += region) {
    const std::size_t bytes = std::min(region, total - off);
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) {
      std::perror("mmap");
      std::exit(1);
    }
    madvise(p, bytes, MADV_HUGEPAGE);
    for (std::size_t o = 0; o < bytes; o += 4096) static_cast<char*>(p)[o] = 0;
    check(cudaHostRegister(p, bytes, cudaHostRegisterPortable | cudaHostRegisterMapped),
          "cudaHostRegister");
    h.bases.push_back(static_cast<char*>(p));
    h.sizes.push_back(bytes);
  }
  return h;
}

void free_host(Host& h) {
  for (std::size_t i = 0; i < h.bases.size(); ++i) {
    if (h.registered) {
      cudaHostUnregister(h.bases[i]);
      munmap(h.bases[i], h.sizes[i]);
    } else {
      cudaFreeHost(h.bases[i]);
    }
  }
}
}  // namespace

int main() {
  cudaStream_t s = nullptr;
  check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "stream");
  std::printf(
      "| host memory | piece | direction | us a piece to submit | us a piece until copied |\n");
  std::printf("| --- | --- | --- | --- | --- |\n");
  for (std::size_t piece : {std::size_t{4} << 10, std::size_t{64} << 10, std::size_t{512} << 10,
                            std::size_t{2} << 20}) {
    char* dev = nullptr;
    check(cudaMalloc(&dev, kPieces * piece), "cudaMalloc");
    for (const char* kind : {"cudaHostAlloc", "register-one", "register-64MiB"}) {
      Host h = make_host(kind, piece);
      std::vector<std::size_t> order(kSlots);
      std::iota(order.begin(), order.end(), 0);
      std::shuffle(order.begin(), order.end(), std::mt19937(7));
      for (int d2h = 1; d2h >= 0; --d2h) {
        double best = 1e30, copy = 0;
        for (int r = 0; r < 5; ++r) {
          check(cudaStreamSynchronize(s), "sync");
          std::vector<void*> src(kBatch), dst(kBatch);
          std::vector<std::size_t> sizes(kBatch, piece);
          const auto t0 = Clock::now();
          for (std::size_t b = 0; b < kPieces; b += kBatch) {
            for (std::size_t i = 0; i < kBatch; ++i) {
              char* host = h.slot(order[b + i], piece);
              char* d = dev + (b + i) * piece;
              src[i] = d2h ? static_cast<void*>(d) : host;
              dst[i] = d2h ? static_cast<void*>(host) : d;
            }
            cudaMemcpyAttributes attr{};
            attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
            std::size_t idx = 0;
            check(cudaMemcpyBatchAsync(dst.data(), src.data(), sizes.data(), kBatch, &attr, &idx, 1,
                                       s),
                  "batch");
          }
          const double us = std::chrono::duration<double, std::micro>(Clock::now() - t0).count();
          check(cudaStreamSynchronize(s), "sync");
          const double all = std::chrono::duration<double, std::micro>(Clock::now() - t0).count();
          if (us < best) {
            best = us;
            copy = all;
          }
        }
        std::printf("| %s | %zu KiB | %s | %.2f | %.2f |\n", kind, piece >> 10,
                    d2h ? "to host" : "to device", best / kPieces, copy / kPieces);
      }
      free_host(h);
    }
    cudaFree(dev);
  }
  return 0;
}
