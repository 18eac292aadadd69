// What each CUDA call of a staging window costs the calling thread (cpp/cuda/staging_lane.cu:
// per window two event waits, two event records, one DMA batch and one kernel launch), one kind
// at a time, 2000 calls in a row, best of 5 rounds; then a whole window's calls in the order a
// store makes them. The kernel is launched with a parameter block of the gather/scatter kernel's
// size (a MoveBatch of 224 pages, 3.6 KiB) and with smaller ones, since a launch copies its
// parameters into the command stream.
//
//   build/gpu/hicache_bench_window_calls      (scripts/gpu_run.sh bench-lowlevel runs it)
#include <cuda_runtime.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <vector>

#include "exit_on_cuda_error.cuh"

namespace {

template <int N>
struct Params {
  int count;
  long long blocks[N];
  char* hosts[N];
};

template <int N>
__global__ void touch(Params<N> p, int* out) {
  if (threadIdx.x == 0 && blockIdx.x == 0 && p.count < 0) *out = p.blocks[0] != 0;
}

using Clock = std::chrono::steady_clock;
constexpr int kCalls = 2000;
constexpr int kRounds = 5;

// Microseconds a call, best of kRounds rounds of kCalls calls (the stream drained between).
double per_call(const std::function<void()>& call, cudaStream_t a, cudaStream_t b) {
  double best = 1e30;
  for (int r = 0; r < kRounds; ++r) {
    check(cudaStreamSynchronize(a), "sync");
    check(cudaStreamSynchronize(b), "sync");
    const auto t0 = Clock::now();
    for (int i = 0; i < kCalls; ++i) call();
    const double us = std::chrono::duration<double, std::micro>(Clock::now() - t0).count();
    best = std::min(best, us / kCalls);
  }
  check(cudaStreamSynchronize(a), "sync");
  check(cudaStreamSynchronize(b), "sync");
  return best;
}

// As cpp/cuda/dma_batch.cu submits a window's pieces.
void dma_batch(void** dst, void** src, std::size_t* sizes, std::size_t n, cudaStream_t s) {
  cudaMemcpyAttributes attr{};
  attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
  std::size_t index = 0;
  check(cudaMemcpyBatchAsync(dst, src, sizes, n, &attr, &index, 1, s), "cudaMemcpyBatchAsync");
}

}  // namespace

int main() {
  cudaStream_t dma = nullptr, caller = nullptr;
  check(cudaStreamCreateWithFlags(&dma, cudaStreamNonBlocking), "stream");
  check(cudaStreamCreateWithFlags(&caller, cudaStreamNonBlocking), "stream");
  cudaEvent_t ev[2];
  for (auto& e : ev) check(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "event");
  int* out = nullptr;
  check(cudaMalloc(&out, sizeof(int)), "cudaMalloc");
  constexpr std::size_t kPiece = 4096, kPieces = 64;
  char* host = nullptr;
  char* dev = nullptr;
  check(cudaMallocHost(&host, kPiece * kPieces), "cudaMallocHost");
  check(cudaMalloc(&dev, kPiece * kPieces), "cudaMalloc");
  std::vector<void*> src(kPieces), dst(kPieces);
  std::vector<std::size_t> sizes(kPieces, kPiece);
  for (std::size_t i = 0; i < kPieces; ++i) {
    src[i] = dev + i * kPiece;
    dst[i] = host + i * kPiece;
  }
  Params<224> p224{};
  Params<64> p64{};
  Params<16> p16{};
  Params<1> p1{};
  check(cudaEventRecord(ev[0], dma), "record");
  check(cudaEventRecord(ev[1], caller), "record");

  std::printf("| CUDA call (what a staging window makes) | us a call |\n| --- | --- |\n");
  auto row = [&](const char* name, const std::function<void()>& call) {
    std::printf("| %s | %.2f |\n", name, per_call(call, dma, caller));
  };
  row("cudaEventRecord", [&] { check(cudaEventRecord(ev[0], dma), "record"); });
  row("cudaStreamWaitEvent", [&] { check(cudaStreamWaitEvent(caller, ev[0], 0), "wait"); });
  row("launch, 3.6 KiB of parameters (224 pages)",
      [&] { touch<224><<<32, 1024, 0, caller>>>(p224, out); });
  row("launch, 1 KiB of parameters (64 pages)",
      [&] { touch<64><<<32, 1024, 0, caller>>>(p64, out); });
  row("launch, 264 B of parameters (16 pages)",
      [&] { touch<16><<<32, 1024, 0, caller>>>(p16, out); });
  row("launch, 24 B of parameters", [&] { touch<1><<<32, 1024, 0, caller>>>(p1, out); });
  for (std::size_t n : {1, 4, 16, 64}) {
    char name[96];
    std::snprintf(name, sizeof name, "cudaMemcpyBatchAsync, %zu pieces of 4 KiB, D2H", n);
    row(name, [&] { dma_batch(dst.data(), src.data(), sizes.data(), n, dma); });
  }
  row("cudaMemcpyAsync, 1 piece of 4 KiB, D2H", [&] {
    check(cudaMemcpyAsync(host, dev, kPiece, cudaMemcpyDeviceToHost, dma), "cudaMemcpyAsync");
  });
  // A store's window: wait for the window, gather, record, the DMA waits, DMA, record.
  for (std::size_t n : {1, 16}) {
    char name[96];
    std::snprintf(name, sizeof name, "a store's window, %zu DMA pieces, 3.6 KiB launch", n);
    row(name, [&] {
      check(cudaStreamWaitEvent(caller, ev[0], 0), "wait");
      touch<224><<<32, 1024, 0, caller>>>(p224, out);
      check(cudaEventRecord(ev[1], caller), "record");
      check(cudaStreamWaitEvent(dma, ev[1], 0), "wait");
      dma_batch(dst.data(), src.data(), sizes.data(), n, dma);
      check(cudaEventRecord(ev[0], dma), "record");
    });
  }
  row("a store's window, 16 DMA pieces, 264 B launch", [&] {
    check(cudaStreamWaitEvent(caller, ev[0], 0), "wait");
    touch<16><<<32, 1024, 0, caller>>>(p16, out);
    check(cudaEventRecord(ev[1], caller), "record");
    check(cudaStreamWaitEvent(dma, ev[1], 0), "wait");
    dma_batch(dst.data(), src.data(), sizes.data(), 16, dma);
    check(cudaEventRecord(ev[0], dma), "record");
  });
  check(cudaDeviceSynchronize(), "sync");
  return 0;
}
