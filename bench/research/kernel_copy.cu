// The kernel path's own limit on small pages: the copier's gather/scatter kernel
// (cpp/cuda/page_copy_kernel.cuh) over 1024 pages of one or two segments between shuffled
// pinned host slots and shuffled device blocks, by CTA count and by pages a launch (the
// copier's 224, which keep the parameter block under 4 KiB, against 2000 in one block of up to
// 32 KiB, which CUDA 12.1 and later take), against one contiguous cudaMemcpyAsync of the same
// bytes. Each direction alone and both at once (a store on one stream, a load on another, against
// two contiguous copies on two streams); wall time from the first launch until the stream is
// done, best of 7.
//
//   build/gpu/hicache_bench_kernel_copy      (scripts/gpu_run.sh bench-lowlevel runs it)
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <numeric>
#include <random>
#include <vector>

#include "exit_on_cuda_error.cuh"
#include "page_copy_kernel.cuh"

namespace {
using hicache::cuda::MoveBatchOf;
using hicache::cuda::page_copy_kernel;
using hicache::cuda::SegmentDesc;
using Clock = std::chrono::steady_clock;
constexpr int kPages = 1024, kSlots = 2 * kPages, kThreads = 1024, kReps = 7;
using Big = MoveBatchOf<2000>;  // 4 + 2000 * 16 bytes: under the 32764-byte parameter limit

struct Move {
  long long block;
  char* host;
};

struct Layout {
  long long chunk;
  int segments;
  long long page() const { return chunk * segments; }
};

struct Pools {
  std::vector<char*> dev;  // one buffer of kSlots blocks a segment
  char* host = nullptr;    // kSlots pages, mapped
  SegmentDesc* table = nullptr;
  long long tiles_per_page = 0;
  std::vector<Move> stores, loads;  // disjoint slots and blocks
};

Pools make_pools(const Layout& l) {
  Pools p;
  std::vector<SegmentDesc> rows;
  const long long tile = static_cast<long long>(kThreads) * 16;
  for (int s = 0; s < l.segments; ++s) {
    char* d = nullptr;
    check(cudaMalloc(&d, kSlots * l.chunk), "cudaMalloc");
    check(cudaMemset(d, s + 1, kSlots * l.chunk), "cudaMemset");
    p.dev.push_back(d);
    rows.push_back({d, l.chunk, l.chunk, s * l.chunk, p.tiles_per_page});
    p.tiles_per_page += (l.chunk + tile - 1) / tile;
  }
  check(cudaMalloc(&p.table, rows.size() * sizeof(SegmentDesc)), "cudaMalloc(table)");
  check(cudaMemcpy(p.table, rows.data(), rows.size() * sizeof(SegmentDesc), cudaMemcpyHostToDevice),
        "table");
  check(cudaHostAlloc(reinterpret_cast<void**>(&p.host), kSlots * l.page(),
                      cudaHostAllocPortable | cudaHostAllocMapped),
        "cudaHostAlloc");
  std::fill(p.host, p.host + kSlots * l.page(), char{0});
  std::vector<int> slots(kSlots), blocks(kSlots);
  std::iota(slots.begin(), slots.end(), 0);
  std::iota(blocks.begin(), blocks.end(), 0);
  std::mt19937 rng(7);
  std::shuffle(slots.begin(), slots.end(), rng);
  std::shuffle(blocks.begin(), blocks.end(), rng);
  for (int i = 0; i < kSlots; ++i) {
    (i < kPages ? p.stores : p.loads).push_back({blocks[i], p.host + slots[i] * l.page()});
  }
  return p;
}

void free_pools(Pools& p) {
  for (char* d : p.dev) cudaFree(d);
  cudaFree(p.table);
  cudaFreeHost(p.host);
}

template <class Batch, bool kToHost>
void launch(const Pools& p, int nseg, const std::vector<Move>& moves, int ctas, cudaStream_t s) {
  static Batch batch;  // up to 32 KiB: not on the stack
  for (std::size_t first = 0; first < moves.size(); first += Batch::kCapacity) {
    batch.count = static_cast<int>(std::min<std::size_t>(Batch::kCapacity, moves.size() - first));
    for (int i = 0; i < batch.count; ++i) {
      batch.blocks[i] = moves[first + i].block;
      batch.hosts[i] = moves[first + i].host;
    }
    const int blocks = hicache::cuda::launch_ctas(batch.count, p.tiles_per_page, ctas);
    page_copy_kernel<uint4, hicache::cuda::kUnroll<uint4, kToHost>, kToHost, Batch>
        <<<blocks, kThreads, 0, s>>>(p.table, nseg, p.tiles_per_page, batch);
    check(cudaGetLastError(), "launch");
  }
}

template <class F>
double best_us(F&& enqueue_and_wait) {
  double best = 1e30;
  for (int r = 0; r < kReps; ++r) {
    const auto t0 = Clock::now();
    enqueue_and_wait();
    best = std::min(best, std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
  }
  return best;
}

template <class Batch>
void row(const Pools& p, const Layout& l, int ctas, int per_launch, cudaStream_t a, cudaStream_t b,
         double contig_store, double contig_load, double contig_both) {
  const double store = best_us([&] {
    launch<Batch, true>(p, l.segments, p.stores, ctas, a);
    check(cudaStreamSynchronize(a), "sync");
  });
  const double load = best_us([&] {
    launch<Batch, false>(p, l.segments, p.loads, ctas, a);
    check(cudaStreamSynchronize(a), "sync");
  });
  const double both = best_us([&] {
    launch<Batch, true>(p, l.segments, p.stores, ctas, a);
    launch<Batch, false>(p, l.segments, p.loads, ctas, b);
    check(cudaStreamSynchronize(a), "sync");
    check(cudaStreamSynchronize(b), "sync");
  });
  std::printf("| %lld KiB x %d | %d | %d | %.3f | %.3f | %.3f | %.0f / %.0f / %.0f |\n",
              l.chunk >> 10, l.segments, ctas, per_launch, contig_store / store, contig_load / load,
              contig_both / both, store, load, both);
}
}  // namespace

int main() {
  cudaStream_t a = nullptr, b = nullptr;
  check(cudaStreamCreateWithFlags(&a, cudaStreamNonBlocking), "stream");
  check(cudaStreamCreateWithFlags(&b, cudaStreamNonBlocking), "stream");
  std::printf(
      "| layout | CTAs | pages a launch | store | load | both at once | us: store / load / both "
      "|\n| --- | --- | --- | --- | --- | --- | --- |\n");
  for (Layout l :
       {Layout{16 << 10, 1}, Layout{32 << 10, 1}, Layout{64 << 10, 1}, Layout{128 << 10, 1},
        Layout{144 << 10, 1}, Layout{16 << 10, 2}, Layout{64 << 10, 2}, Layout{144 << 10, 2}}) {
    Pools p = make_pools(l);
    const long long bytes = kPages * l.page();
    char *dev = nullptr, *dev2 = nullptr;
    check(cudaMalloc(&dev, bytes), "cudaMalloc");
    check(cudaMalloc(&dev2, bytes), "cudaMalloc");
    char* host2 = p.host + bytes;  // the pool's second half
    const double cs = best_us([&] {
      check(cudaMemcpyAsync(p.host, dev, bytes, cudaMemcpyDeviceToHost, a), "copy");
      check(cudaStreamSynchronize(a), "sync");
    });
    const double cl = best_us([&] {
      check(cudaMemcpyAsync(dev, p.host, bytes, cudaMemcpyHostToDevice, a), "copy");
      check(cudaStreamSynchronize(a), "sync");
    });
    const double cb = best_us([&] {
      check(cudaMemcpyAsync(p.host, dev, bytes, cudaMemcpyDeviceToHost, a), "copy");
      check(cudaMemcpyAsync(dev2, host2, bytes, cudaMemcpyHostToDevice, b), "copy");
      check(cudaStreamSynchronize(a), "sync");
      check(cudaStreamSynchronize(b), "sync");
    });
    for (int ctas : {4, 8, 16, 32}) {
      row<hicache::cuda::MoveBatch>(p, l, ctas, hicache::cuda::kMaxMovesPerLaunch, a, b, cs, cl,
                                    cb);
      row<Big>(p, l, ctas, Big::kCapacity, a, b, cs, cl, cb);
    }
    cudaFree(dev);
    cudaFree(dev2);
    free_pools(p);
  }
  return 0;
}
