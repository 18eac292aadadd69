// What submitting DMA pieces costs the calling thread: 1 GiB in 8192 scattered pieces of 128 KiB
// (a layer-major pool's chunks), pinned host memory <-> device, through cudaMemcpyBatchAsync in
// batches of 16 to 8192 pieces, from 1, 2 or 4 threads on their own streams at once, and one
// cudaMemcpyAsync per piece. Prints the submission time (the calling threads' CPU) and the time
// until the copies are done, best of 4.
//
//   build/gpu/hicache_bench_dma_submit      (scripts/gpu_run.sh bench-lowlevel runs it)
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <thread>
#include <vector>

#include "exit_on_cuda_error.cuh"

namespace {

using Clock = std::chrono::steady_clock;
double since(Clock::time_point t0, Clock::time_point t1) {
  return std::chrono::duration<double>(t1 - t0).count();
}

constexpr std::size_t kPiece = std::size_t{128} << 10;
constexpr std::size_t kPieces = 8192;  // 1 GiB

struct Pieces {
  std::vector<void*> dst, src;
  std::vector<std::size_t> sizes;
};

// Host pieces in order, device pieces at shuffled places (every other slot of 2 GiB).
Pieces pieces(char* host, char* dev, bool to_device, const std::vector<std::size_t>& perm) {
  Pieces p{std::vector<void*>(kPieces), std::vector<void*>(kPieces),
           std::vector<std::size_t>(kPieces, kPiece)};
  for (std::size_t i = 0; i < kPieces; ++i) {
    void* h = host + i * kPiece;
    void* d = dev + perm[i] * kPiece * 2;
    p.dst[i] = to_device ? d : h;
    p.src[i] = to_device ? h : d;
  }
  return p;
}

void submit(Pieces& p, std::size_t first, std::size_t last, std::size_t batch, cudaStream_t s) {
  cudaMemcpyAttributes attr{};
  attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
  std::size_t attr_index = 0;
  for (std::size_t b = first; b < last; b += batch) {
    const std::size_t m = std::min(batch, last - b);
    check(cudaMemcpyBatchAsync(p.dst.data() + b, p.src.data() + b, p.sizes.data() + b, m, &attr,
                               &attr_index, 1, s),
          "cudaMemcpyBatchAsync");
  }
}

}  // namespace

int main() {
  char* host = nullptr;
  char* dev = nullptr;
  check(cudaHostAlloc(&host, kPiece * kPieces, cudaHostAllocDefault), "cudaHostAlloc");
  check(cudaMalloc(&dev, kPiece * kPieces * 2), "cudaMalloc");
  std::vector<std::size_t> perm(kPieces);
  for (std::size_t i = 0; i < kPieces; ++i) perm[i] = i;
  std::shuffle(perm.begin(), perm.end(), std::mt19937(1));
  std::vector<cudaStream_t> streams(4);
  for (auto& s : streams) check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "stream");
  const double gb = static_cast<double>(kPiece * kPieces) / 1e9;

  std::printf(
      "| pieces submitted as | direction | submit (ms) | us a piece | done (ms) | GB/s |\n");
  std::printf("| --- | --- | --- | --- | --- | --- |\n");
  for (bool to_device : {true, false}) {
    for (std::size_t batch : {16, 64, 128, 512, 2048, 8192}) {
      double sub = 1e9, all = 1e9;
      for (int rep = 0; rep < 4; ++rep) {
        Pieces p = pieces(host, dev, to_device, perm);
        check(cudaDeviceSynchronize(), "sync");
        const auto t0 = Clock::now();
        submit(p, 0, kPieces, batch, streams[0]);
        const auto t1 = Clock::now();
        check(cudaDeviceSynchronize(), "sync");
        sub = std::min(sub, since(t0, t1));
        all = std::min(all, since(t0, Clock::now()));
      }
      std::printf("| batches of %zu | %s | %.2f | %.3f | %.2f | %.1f |\n", batch,
                  to_device ? "H2D" : "D2H", sub * 1e3, sub * 1e6 / kPieces, all * 1e3, gb / all);
    }
  }
  for (int threads : {2, 4}) {
    double sub = 1e9, all = 1e9;
    for (int rep = 0; rep < 4; ++rep) {
      Pieces p = pieces(host, dev, true, perm);
      check(cudaDeviceSynchronize(), "sync");
      const auto t0 = Clock::now();
      std::vector<std::thread> pool;
      for (int t = 0; t < threads; ++t) {
        pool.emplace_back([&, t] {
          submit(p, kPieces * t / threads, kPieces * (t + 1) / threads, 128, streams[t]);
        });
      }
      for (auto& th : pool) th.join();
      const auto t1 = Clock::now();
      check(cudaDeviceSynchronize(), "sync");
      sub = std::min(sub, since(t0, t1));
      all = std::min(all, since(t0, Clock::now()));
    }
    std::printf("| %d threads, batches of 128 | H2D | %.2f | %.3f | %.2f | %.1f |\n", threads,
                sub * 1e3, sub * 1e6 / kPieces, all * 1e3, gb / all);
  }
  double sub = 1e9;
  for (int rep = 0; rep < 3; ++rep) {
    Pieces p = pieces(host, dev, true, perm);
    const auto t0 = Clock::now();
    for (std::size_t i = 0; i < kPieces; ++i) {
      check(cudaMemcpyAsync(p.dst[i], p.src[i], kPiece, cudaMemcpyDefault, streams[0]), "copy");
    }
    sub = std::min(sub, since(t0, Clock::now()));
    check(cudaDeviceSynchronize(), "sync");
  }
  std::printf("| one cudaMemcpyAsync each | H2D | %.2f | %.3f | | |\n", sub * 1e3,
              sub * 1e6 / kPieces);
  return 0;
}
