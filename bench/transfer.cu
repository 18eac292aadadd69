// bench/transfer: hicache's CUDA copier against the alternatives, side by side in one run.
//
// For page geometries of real models, in both directions: our gather/scatter kernel, one
// contiguous cudaMemcpyAsync of the same bytes (the DMA ceiling), cub::DeviceMemcpy::Batched and
// cudaMemcpyBatchAsync over the same scattered chunks; both directions at once on two streams;
// our kernel's grid size; and the pinning rate of a large host pool. Prints a markdown table.
//
// usage: hicache_bench_transfer [--pool-gib N] [--reps N] [--out FILE]

#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <cub/device/device_memcpy.cuh>
#include <fstream>
#include <numeric>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "hicache/hicache.hpp"
#include "pinned_allocator.hpp"

namespace {

#define CK(call)                                                                                 \
  do {                                                                                           \
    cudaError_t e_ = (call);                                                                     \
    if (e_ != cudaSuccess) {                                                                     \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e_)); \
      std::exit(1);                                                                              \
    }                                                                                            \
  } while (0)

struct Geometry {
  const char* name;
  int segments;
  std::int64_t block_bytes;  // per segment
  int pages;
};

int reps = 10;
std::ostringstream report;

template <typename F>
double median_ms(cudaStream_t s, F&& f) {
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  for (int i = 0; i < 2; ++i) f();  // warm-up
  CK(cudaStreamSynchronize(s));
  std::vector<float> t;
  for (int i = 0; i < reps; ++i) {
    CK(cudaEventRecord(a, s));
    f();
    CK(cudaEventRecord(b, s));
    CK(cudaEventSynchronize(b));
    float ms;
    CK(cudaEventElapsedTime(&ms, a, b));
    t.push_back(ms);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

template <typename F>
double median_wall_ms(F&& f) {
  for (int i = 0; i < 2; ++i) f();
  std::vector<double> t;
  for (int i = 0; i < reps; ++i) {
    CK(cudaDeviceSynchronize());
    auto t0 = std::chrono::steady_clock::now();
    f();
    CK(cudaDeviceSynchronize());
    t.push_back(
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

double gbps(double bytes, double ms) { return bytes / (ms * 1e6); }

// One geometry: device segments with twice the blocks a batch uses, a pinned pool of `pages`
// slots, and the chunk lists the batched APIs take.
struct Setup {
  Geometry g;
  std::vector<hicache::Segment> segs;
  std::shared_ptr<hicache::Copier> copier;  // hicache's default choice for this geometry
  std::shared_ptr<hicache::Copier> staged;  // always staged (DMA for whole pages + HBM scatter)
  std::shared_ptr<hicache::Copier> kernel;  // always the kernel across PCIe
  std::shared_ptr<hicache::Copier> dma;     // always the DMA engines, one piece per chunk
  const char* auto_path = "kernel";
  std::unique_ptr<hicache::PageLayout> layout;
  std::unique_ptr<hicache::HostPool> pool;
  std::vector<hicache::PageMove> moves, moves2;  // two disjoint batches (two-direction test)
  std::size_t bytes = 0;

  Setup(Geometry geo, int cuda_blocks, std::size_t staging_bytes = std::size_t{16} << 20) : g(geo) {
    const std::int64_t num_blocks = 2 * g.pages + 2;
    for (int s = 0; s < g.segments; ++s) {
      void* p;
      CK(cudaMalloc(&p, static_cast<std::size_t>(num_blocks * g.block_bytes)));
      CK(cudaMemset(p, s + 1, static_cast<std::size_t>(num_blocks * g.block_bytes)));
      segs.push_back({p, num_blocks, g.block_bytes, g.block_bytes});
    }
    layout =
        std::make_unique<hicache::PageLayout>(segs, hicache::Device{hicache::DeviceKind::kCuda, 0});
    hicache::CudaCopierOptions o;
    o.max_blocks = cuda_blocks;
    o.staging_bytes = staging_bytes;
    auto with_path = [&](hicache::CopyPath p) {
      hicache::CudaCopierOptions q = o;
      q.path = p;
      auto c = hicache::make_cuda_copier(0, q);
      c->bind(*layout);
      return c;
    };
    copier = with_path(hicache::CopyPath::kAuto);
    staged = with_path(hicache::CopyPath::kStaged);
    kernel = with_path(hicache::CopyPath::kKernel);
    dma = with_path(hicache::CopyPath::kDma);
    auto_path = copier->path();
    pool = std::make_unique<hicache::HostPool>(layout->page_bytes(), 2 * g.pages,
                                               std::size_t{1} << 30, copier->host_allocator());
    // Engine blocks and host slots both in random order: a full cache reuses the slots of
    // evicted pages, so a batch's host pages are not adjacent (adjacent ones would merge into
    // larger DMA pieces and flatter the staged path).
    std::vector<std::int64_t> perm(static_cast<std::size_t>(num_blocks));
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), std::mt19937(1));
    std::vector<std::int64_t> slots(static_cast<std::size_t>(2 * g.pages));
    std::iota(slots.begin(), slots.end(), 0);
    std::shuffle(slots.begin(), slots.end(), std::mt19937(2));
    for (int i = 0; i < g.pages; ++i) {
      const auto u = static_cast<std::size_t>(i);
      moves.push_back({perm[u], pool->slot(slots[u])});
      moves2.push_back({perm[static_cast<std::size_t>(g.pages) + u],
                        pool->slot(slots[static_cast<std::size_t>(g.pages) + u])});
    }
    bytes = layout->page_bytes() * static_cast<std::size_t>(g.pages);
  }
  ~Setup() {
    pool.reset();
    for (auto& s : segs) cudaFree(s.base);
  }
  void chunks(bool to_host, std::vector<void*>& src, std::vector<void*>& dst,
              std::vector<std::size_t>& n) {
    for (const auto& m : moves) {
      for (std::size_t s = 0; s < segs.size(); ++s) {
        void* dev = layout->block_address(s, m.block);
        void* host = m.host + layout->page_offset(s);
        src.push_back(to_host ? dev : host);
        dst.push_back(to_host ? host : dev);
        n.push_back(static_cast<std::size_t>(segs[s].block_bytes));
      }
    }
  }
};

void bench_geometry(const Geometry& g, cudaStream_t s, cudaStream_t s2) {
  Setup st(g, 4);
  const double B = static_cast<double>(st.bytes);
  void *dev_flat, *host_flat;
  CK(cudaMalloc(&dev_flat, st.bytes));
  CK(cudaHostAlloc(&host_flat, st.bytes, cudaHostAllocPortable));
  void *dev_flat2, *host_flat2;
  CK(cudaMalloc(&dev_flat2, st.bytes));
  CK(cudaHostAlloc(&host_flat2, st.bytes, cudaHostAllocPortable));

  // Correctness first: a round trip through each path must return the bytes.
  for (auto* c : {st.copier.get(), st.staged.get(), st.kernel.get()}) {
    CK(cudaMemset(st.layout->block_address(0, st.moves2.back().block), 0xAB,
                  static_cast<std::size_t>(g.block_bytes)));
    CK(cudaDeviceSynchronize());
    c->copy_pages(hicache::Direction::kToHost, *st.layout, st.moves, s);
    std::vector<hicache::PageMove> back;
    for (std::size_t i = 0; i < st.moves.size(); ++i)
      back.push_back({st.moves2[i].block, st.moves[i].host});
    c->copy_pages(hicache::Direction::kToDevice, *st.layout, back, s);
    CK(cudaStreamSynchronize(s));
    for (std::size_t seg : {std::size_t{0}, st.segs.size() - 1}) {
      std::vector<char> a(static_cast<std::size_t>(g.block_bytes)), b(a.size());
      CK(cudaMemcpy(a.data(), st.layout->block_address(seg, st.moves.back().block), a.size(),
                    cudaMemcpyDeviceToHost));
      CK(cudaMemcpy(b.data(), st.layout->block_address(seg, st.moves2.back().block), b.size(),
                    cudaMemcpyDeviceToHost));
      if (a != b) {
        std::fprintf(stderr, "%s: a round trip differs\n", g.name);
        std::exit(1);
      }
    }
  }

  for (bool to_host : {false, true}) {
    const auto dir = to_host ? hicache::Direction::kToHost : hicache::Direction::kToDevice;
    const double ceil_ms = median_ms(s, [&] {
      CK(to_host ? cudaMemcpyAsync(host_flat, dev_flat, st.bytes, cudaMemcpyDeviceToHost, s)
                 : cudaMemcpyAsync(dev_flat, host_flat, st.bytes, cudaMemcpyHostToDevice, s));
    });
    const double ours_ms =
        median_ms(s, [&] { st.copier->copy_pages(dir, *st.layout, st.moves, s); });
    const double staged_ms =
        median_ms(s, [&] { st.staged->copy_pages(dir, *st.layout, st.moves, s); });
    const double kernel_ms =
        median_ms(s, [&] { st.kernel->copy_pages(dir, *st.layout, st.moves, s); });

    std::vector<void*> src, dst;
    std::vector<std::size_t> n;
    st.chunks(to_host, src, dst, n);
    void **d_src, **d_dst;
    std::size_t* d_n;
    CK(cudaMalloc(&d_src, src.size() * sizeof(void*)));
    CK(cudaMalloc(&d_dst, dst.size() * sizeof(void*)));
    CK(cudaMalloc(&d_n, n.size() * sizeof(std::size_t)));
    CK(cudaMemcpy(d_src, src.data(), src.size() * sizeof(void*), cudaMemcpyHostToDevice));
    CK(cudaMemcpy(d_dst, dst.data(), dst.size() * sizeof(void*), cudaMemcpyHostToDevice));
    CK(cudaMemcpy(d_n, n.data(), n.size() * sizeof(std::size_t), cudaMemcpyHostToDevice));
    std::size_t temp_bytes = 0;
    CK(cub::DeviceMemcpy::Batched(nullptr, temp_bytes, d_src, d_dst, d_n,
                                  static_cast<std::int64_t>(n.size()), s));
    void* temp;
    CK(cudaMalloc(&temp, temp_bytes));
    const double cub_ms = median_ms(s, [&] {
      CK(cub::DeviceMemcpy::Batched(temp, temp_bytes, d_src, d_dst, d_n,
                                    static_cast<std::int64_t>(n.size()), s));
    });
    cudaMemcpyAttributes attr{};
    attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
    std::size_t attr_idx = 0;
    const double batch_ms = median_ms(s, [&] {
      CK(cudaMemcpyBatchAsync(dst.data(), src.data(), n.data(), n.size(), &attr, &attr_idx, 1, s));
    });
    cudaFree(temp);
    cudaFree(d_src);
    cudaFree(d_dst);
    cudaFree(d_n);

    char line[512];
    std::snprintf(line, sizeof line,
                  "| %s | %s | %.2f GB, %zu chunks of %lld KiB | %.1f | **%.1f (%.3f)** %s | "
                  "%.1f (%.3f) | %.1f (%.3f) | %.1f (%.3f) | %.1f (%.3f) |\n",
                  g.name, to_host ? "D2H (store)" : "H2D (load)", B / 1e9, n.size(),
                  static_cast<long long>(g.block_bytes >> 10), gbps(B, ceil_ms), gbps(B, ours_ms),
                  ceil_ms / ours_ms, st.auto_path, gbps(B, staged_ms), ceil_ms / staged_ms,
                  gbps(B, kernel_ms), ceil_ms / kernel_ms, gbps(B, cub_ms), ceil_ms / cub_ms,
                  gbps(B, batch_ms), ceil_ms / batch_ms);
    report << line;
  }

  // Both directions at once: store on one stream, load on another.
  const double two_ceil = median_wall_ms([&] {
    CK(cudaMemcpyAsync(host_flat, dev_flat, st.bytes, cudaMemcpyDeviceToHost, s));
    CK(cudaMemcpyAsync(dev_flat2, host_flat2, st.bytes, cudaMemcpyHostToDevice, s2));
  });
  auto both = [&](hicache::Copier& store, hicache::Copier& load) {
    return median_wall_ms([&] {
      store.copy_pages(hicache::Direction::kToHost, *st.layout, st.moves, s);
      load.copy_pages(hicache::Direction::kToDevice, *st.layout, st.moves2, s2);
    });
  };
  const double two_ours = both(*st.copier, *st.copier);
  const double two_staged = both(*st.staged, *st.staged);
  const double two_kernel = both(*st.kernel, *st.kernel);
  const double two_dma = both(*st.dma, *st.dma);
  char line[512];
  std::snprintf(line, sizeof line,
                "| %s | both at once | %.2f GB each way | %.1f | **%.1f (%.3f)** %s | staged both: "
                "%.1f (%.3f) | kernel both: %.1f (%.3f) | DMA both: %.1f (%.3f) | | |\n",
                g.name, B / 1e9, gbps(2 * B, two_ceil), gbps(2 * B, two_ours), two_ceil / two_ours,
                st.auto_path, gbps(2 * B, two_staged), two_ceil / two_staged,
                gbps(2 * B, two_kernel), two_ceil / two_kernel, gbps(2 * B, two_dma),
                two_ceil / two_dma);
  report << line;

  cudaFree(dev_flat);
  cudaFree(dev_flat2);
  cudaFreeHost(host_flat);
  cudaFreeHost(host_flat2);
}

// Grid size: CTAs of the staged path's scatter/gather and of the kernel across PCIe.
void bench_grid(const Geometry& g, cudaStream_t s) {
  report << "\n| " << g.name
         << ": CTAs | staged H2D GB/s | staged D2H GB/s | kernel H2D GB/s | kernel D2H GB/s |\n"
            "| --- | --- | --- | --- | --- |\n";
  for (int blocks : {1, 2, 4, 8, 16}) {
    Setup st(g, blocks);
    const double B = static_cast<double>(st.bytes);
    double r[4];
    int k = 0;
    for (auto* c : {st.staged.get(), st.kernel.get()}) {
      for (auto dir : {hicache::Direction::kToDevice, hicache::Direction::kToHost}) {
        r[k++] = gbps(B, median_ms(s, [&] { c->copy_pages(dir, *st.layout, st.moves, s); }));
      }
    }
    char line[160];
    std::snprintf(line, sizeof line, "| %d%s | %.1f | %.1f | %.1f | %.1f |\n", blocks,
                  blocks == 4 ? " (default)" : "", r[0], r[1], r[2], r[3]);
    report << line;
  }
}

// Where staging starts to pay: layer-major pages of 16 segments, from 128 KiB to 1 MiB, with
// host slots in random order (one DMA piece a page).
void bench_page_sweep(cudaStream_t s) {
  report << "\n| layer-major page (16 chunks) | contiguous GB/s | staged H2D | staged D2H | "
            "kernel H2D | kernel D2H |\n| --- | --- | --- | --- | --- | --- |\n";
  for (std::int64_t chunk_kib : {8, 16, 32, 64}) {
    const int pages = static_cast<int>((std::int64_t{512} << 20) / (16 * (chunk_kib << 10)));
    Setup st({"sweep", 16, chunk_kib << 10, pages}, 4);
    const double B = static_cast<double>(st.bytes);
    void *dev, *host;
    CK(cudaMalloc(&dev, st.bytes));
    CK(cudaHostAlloc(&host, st.bytes, cudaHostAllocPortable));
    const double ceil_ms =
        median_ms(s, [&] { CK(cudaMemcpyAsync(dev, host, st.bytes, cudaMemcpyHostToDevice, s)); });
    double r[4];
    int k = 0;
    for (auto* c : {st.staged.get(), st.kernel.get()}) {
      for (auto dir : {hicache::Direction::kToDevice, hicache::Direction::kToHost}) {
        r[k++] = median_ms(s, [&] { c->copy_pages(dir, *st.layout, st.moves, s); });
      }
    }
    char line[200];
    std::snprintf(line, sizeof line, "| %lld KiB | %.1f | %.3f | %.3f | %.3f | %.3f |\n",
                  static_cast<long long>(16 * chunk_kib), gbps(B, ceil_ms), ceil_ms / r[0],
                  ceil_ms / r[1], ceil_ms / r[2], ceil_ms / r[3]);
    report << line;
    cudaFree(dev);
    cudaFreeHost(host);
  }
}

// Staging size (device memory per stream and direction) for the Llama geometry.
void bench_staging_size(const Geometry& g, cudaStream_t s) {
  report << "\n| " << g.name << ": staging bytes | H2D GB/s | D2H GB/s |\n| --- | --- | --- |\n";
  for (std::size_t mib : {4, 8, 16, 32, 64}) {
    Setup st(g, 4, mib << 20);
    const double B = static_cast<double>(st.bytes);
    const double h2d = median_ms(
        s, [&] { st.staged->copy_pages(hicache::Direction::kToDevice, *st.layout, st.moves, s); });
    const double d2h = median_ms(
        s, [&] { st.staged->copy_pages(hicache::Direction::kToHost, *st.layout, st.moves, s); });
    char line[128];
    std::snprintf(line, sizeof line, "| %zu MiB%s | %.1f | %.1f |\n", mib,
                  mib == 16 ? " (default)" : "", gbps(B, h2d), gbps(B, d2h));
    report << line;
  }
}

__global__ void spin(long long cycles) {
  const long long start = clock64();
  while (clock64() - start < cycles) {
  }
}

// Does pinning wait for the GPU? Time cudaHostRegister of 256 MiB while a ~100 ms kernel runs.
void bench_pin_while_busy(cudaStream_t s) {
  const std::size_t bytes = std::size_t{256} << 20;
  auto alloc = hicache::cuda::make_pinned_allocator(hicache::cuda::PinMode::kRegister);
  void* warm = alloc->allocate(bytes);  // first use of the path, not timed
  alloc->deallocate(warm, bytes);
  double idle_ms = 0, busy_ms = 0;
  for (int busy = 0; busy < 2; ++busy) {
    CK(cudaDeviceSynchronize());
    if (busy) spin<<<1, 1, 0, s>>>(200'000'000);
    const auto t0 = std::chrono::steady_clock::now();
    void* p = alloc->allocate(bytes);
    const double ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    const bool still_busy = busy && cudaStreamQuery(s) == cudaErrorNotReady;
    (busy ? busy_ms : idle_ms) = ms;
    if (busy) {
      char line[256];
      std::snprintf(
          line, sizeof line,
          "\nPinning 256 MiB (mmap + fault + cudaHostRegister): %.1f ms with the GPU idle, "
          "%.1f ms while a ~100 ms kernel ran (kernel still running after: %s).\n",
          idle_ms, busy_ms, still_busy ? "yes" : "no");
      report << line;
    }
    CK(cudaDeviceSynchronize());
    alloc->deallocate(p, bytes);
  }
}

void bench_pinning(double gib) {
  report << "\n| pinned pool of " << gib
         << " GiB | chunk | seconds | GB/s |\n| --- | --- | --- | --- |\n";
  const std::size_t bytes = static_cast<std::size_t>(gib * (1ull << 30));
  struct Mode {
    const char* name;
    hicache::cuda::PinMode mode;
    std::size_t chunk;
  };
  for (const Mode& m :
       {Mode{"cudaHostAlloc", hicache::cuda::PinMode::kHostAlloc, std::size_t{1} << 30},
        Mode{"mmap + parallel fault + cudaHostRegister", hicache::cuda::PinMode::kRegister,
             std::size_t{256} << 20},
        Mode{"mmap + parallel fault + cudaHostRegister", hicache::cuda::PinMode::kRegister,
             std::size_t{1} << 30}}) {
    auto alloc = hicache::cuda::make_pinned_allocator(m.mode);
    const std::size_t slot = std::size_t{16} << 20;  // Llama-3-8B page
    const auto t0 = std::chrono::steady_clock::now();
    {
      hicache::HostPool pool(slot, static_cast<std::int64_t>(bytes / slot), m.chunk, alloc);
      for (std::int64_t i = 0; i < pool.num_slots(); ++i) pool.slot(i);
      const double sec =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      char line[256];
      std::snprintf(line, sizeof line, "| %s | %zu MiB | %.2f | %.1f |\n", m.name, m.chunk >> 20,
                    sec, static_cast<double>(pool.allocated_bytes()) / sec / 1e9);
      report << line;
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  double pool_gib = 32;
  std::string out;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--pool-gib" && i + 1 < argc)
      pool_gib = std::atof(argv[++i]);
    else if (a == "--reps" && i + 1 < argc)
      reps = std::atoi(argv[++i]);
    else if (a == "--out" && i + 1 < argc)
      out = argv[++i];
    else {
      std::fprintf(stderr, "usage: %s [--pool-gib N] [--reps N] [--out FILE]\n", argv[0]);
      return 2;
    }
  }
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  cudaStream_t s, s2;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  CK(cudaStreamCreateWithFlags(&s2, cudaStreamNonBlocking));
  const Geometry geos[] = {
      {"Llama-3-8B bf16, layer-major", 64, 256 << 10, 64},  // 32 layers x K,V; 16 MiB a page
      {"DeepSeek-V3 MLA fp8, page-major", 1, 61 * 576 * 128, 240},  // 4.5 MB a page
      {"small model, 16 KiB chunks", 48, 16 << 10, 1365},           // 24 layers x K,V
  };
  report
      << "Device: " << prop.name << ", " << prop.multiProcessorCount << " SMs. Median of " << reps
      << " runs; ratio = ceiling time / our time (1.0 = the contiguous cudaMemcpyAsync rate).\n\n"
      << "| geometry | direction | bytes | contiguous cudaMemcpyAsync GB/s | hicache GB/s (ratio) "
         "path | staged only | kernel only | cub::DeviceMemcpy::Batched | cudaMemcpyBatchAsync |\n"
         "| --- | --- | --- | --- | --- | --- | --- | --- | --- |\n";
  for (const auto& g : geos) {
    std::fprintf(stderr, "bench: %s\n", g.name);
    bench_geometry(g, s, s2);
  }
  bench_grid(geos[0], s);
  bench_page_sweep(s);
  bench_staging_size(geos[0], s);
  bench_pin_while_busy(s);
  std::fprintf(stderr, "bench: pinning %.0f GiB\n", pool_gib);
  bench_pinning(pool_gib);
  std::printf("%s", report.str().c_str());
  if (!out.empty()) std::ofstream(out) << report.str();
  return 0;
}
