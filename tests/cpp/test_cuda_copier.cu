// The CUDA path on a real GPU: round trips, streams, in-flight protection, bounds checks.
// Every test skips without a device.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <random>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "hicache/hicache.hpp"
#include "test_support.hpp"

namespace {

using hicache_test::ids;
using hicache_test::tokens;

#define CK(call) ASSERT_EQ((call), cudaSuccess) << #call

__global__ void spin(long long cycles) {
  const long long start = clock64();
  while (clock64() - start < cycles) {
  }
}

constexpr long long kSpinCycles = 200'000'000;  // ~0.1 s at 2 GHz: copies queue behind it

bool have_gpu() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

// Device segments filled with random bytes, with a copy of what was written kept on the host.
class DevicePool {
 public:
  DevicePool(std::int64_t num_blocks, std::vector<std::int64_t> block_bytes, std::int64_t pad = 0) {
    std::mt19937 rng(42);
    for (std::int64_t bytes : block_bytes) {
      const std::int64_t stride = bytes + pad;
      void* p = nullptr;
      EXPECT_EQ(cudaMalloc(&p, static_cast<std::size_t>(stride * num_blocks)), cudaSuccess);
      std::vector<std::uint8_t> host(static_cast<std::size_t>(stride * num_blocks));
      for (auto& b : host) b = static_cast<std::uint8_t>(rng());
      EXPECT_EQ(cudaMemcpy(p, host.data(), host.size(), cudaMemcpyHostToDevice), cudaSuccess);
      segments_.push_back({p, num_blocks, stride, bytes});
    }
  }
  ~DevicePool() {
    for (auto& s : segments_) cudaFree(s.base);
  }
  const std::vector<hicache::Segment>& segments() const { return segments_; }
  std::vector<std::uint8_t> page(std::int64_t block) const {
    std::vector<std::uint8_t> out;
    for (const auto& s : segments_) {
      std::vector<std::uint8_t> b(static_cast<std::size_t>(s.block_bytes));
      cudaMemcpy(b.data(), static_cast<char*>(s.base) + block * s.block_stride, b.size(),
                 cudaMemcpyDeviceToHost);
      out.insert(out.end(), b.begin(), b.end());
    }
    return out;
  }
  // Every byte of `block` set to `value`, on `stream`: the engine's own earlier work.
  void set_async(std::int64_t block, int value, cudaStream_t stream) {
    for (const auto& s : segments_) {
      EXPECT_EQ(cudaMemsetAsync(static_cast<char*>(s.base) + block * s.block_stride, value,
                                static_cast<std::size_t>(s.block_bytes), stream),
                cudaSuccess);
    }
  }
  void clear(std::int64_t block) {
    for (const auto& s : segments_) {
      cudaMemset(static_cast<char*>(s.base) + block * s.block_stride, 0,
                 static_cast<std::size_t>(s.block_bytes));
    }
    cudaDeviceSynchronize();  // ordered before copies on non-blocking streams
  }

 private:
  std::vector<hicache::Segment> segments_;
};

const hicache::Device kGpu{hicache::DeviceKind::kCuda, 0};
hicache::CudaCopierOptions forced(hicache::CopyPath path, std::size_t staging_bytes = 16 << 20) {
  hicache::CudaCopierOptions o;
  o.path = path;
  o.staging_bytes = staging_bytes;
  return o;
}
// No DMA batch, no staging: the gather/scatter kernel across PCIe.
const hicache::CudaCopierOptions kKernelOnly = forced(hicache::CopyPath::kKernel);

hicache::CudaCopierOptions staged(std::size_t staging_bytes) {
  return forced(hicache::CopyPath::kStaged, staging_bytes);
}

// A CUDA copier bound to `layout` (which must outlive it).
std::shared_ptr<hicache::Copier> bound_copier(const hicache::PageLayout& layout,
                                              hicache::CudaCopierOptions opt) {
  auto copier = hicache::make_cuda_copier(0, opt);
  copier->bind(layout);
  return copier;
}

// `n` host slots for `layout`'s pages, from `copier`'s (pinned) allocator.
hicache::HostPool host_slots(const hicache::PageLayout& layout, hicache::Copier& copier,
                             std::int64_t n) {
  return hicache::HostPool(layout.page_bytes(), n, std::size_t{64} << 20, copier.host_allocator());
}

// How a round trip's pages map to host slots.
enum class Slots {
  kShuffled,   // random order (staged DMA pieces are not adjacent), the first two adjacent
  kBackwards,  // page i in slot 2n-1-i, as a store into slots an eviction freed leaf first:
               // adjacent in memory but in reverse (a window sorts them into one piece)
};

// Copier-level round trip: pages of blocks [0, n) go to host slots, are checked there byte for
// byte, then come back into blocks [n, 2n) in another order. With `first_call`, the store goes
// in calls back to back on its stream of first_call, twice that, and so on, as a cache's store
// goes in installments (a staging lane whose DMA is still running continues its windows' growth).
void expect_copier_round_trip(DevicePool& pool, hicache::CudaCopierOptions opt, std::int64_t n,
                              cudaStream_t store_stream, cudaStream_t load_stream,
                              Slots order = Slots::kShuffled, std::int64_t first_call = 0) {
  hicache::PageLayout layout(pool.segments(), kGpu);
  auto copier = bound_copier(layout, opt);
  auto host = host_slots(layout, *copier, 2 * n);
  std::vector<std::int64_t> slot(static_cast<std::size_t>(2 * n));
  for (std::size_t i = 0; i < slot.size(); ++i) slot[i] = static_cast<std::int64_t>(i);
  if (order == Slots::kShuffled) {
    std::shuffle(slot.begin() + 2, slot.end(), std::mt19937(7));
  } else {
    std::reverse(slot.begin(), slot.end());
  }
  std::vector<hicache::PageMove> out, in;
  for (std::int64_t i = 0; i < n; ++i) {
    out.push_back({i, host.slot(slot[static_cast<std::size_t>(i)])});
    in.push_back({2 * n - 1 - i, host.slot(slot[static_cast<std::size_t>(i)])});
  }
  for (std::int64_t i = 0; i < n; ++i) pool.clear(n + i);
  if (first_call == 0) {
    copier->copy_pages(hicache::Direction::kToHost, layout, out, store_stream);
  } else {
    for (std::int64_t i0 = 0, step = first_call; i0 < n; i0 += step, step *= 2) {
      const auto count = static_cast<std::size_t>(std::min(step, n - i0));
      copier->copy_pages(hicache::Direction::kToHost, layout,
                         std::span(out).subspan(static_cast<std::size_t>(i0), count), store_stream);
    }
  }
  auto fence = copier->record(store_stream);
  fence->wait();
  ASSERT_TRUE(fence->done());
  for (std::int64_t i = 0; i < n; ++i) {
    const auto expect = pool.page(i);
    const auto* got = reinterpret_cast<const std::uint8_t*>(out[static_cast<std::size_t>(i)].host);
    ASSERT_TRUE(std::equal(expect.begin(), expect.end(), got)) << "host copy of page " << i;
  }
  copier->copy_pages(hicache::Direction::kToDevice, layout, in, load_stream);
  copier->record(load_stream)->wait();
  for (std::int64_t i = 0; i < n; ++i) {
    ASSERT_EQ(pool.page(2 * n - 1 - i), pool.page(i)) << "page " << i << " loaded back";
  }
}

hicache::HostPrefixCache::AllocateFn give(std::int64_t first) {
  return [first](std::int64_t n) -> std::optional<std::vector<std::int64_t>> {
    return ids(first, n / 128);
  };
}

hicache::CacheConfig config(std::int64_t pages) {
  hicache::CacheConfig c;
  c.capacity_pages = pages;
  return c;
}

void drain(hicache::HostPrefixCache& cache) {
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  cache.poll();
  ASSERT_EQ(cache.stats().transfers_in_flight, 0);
}

void expect_round_trip(DevicePool& pool, std::int64_t pages, cudaStream_t stream,
                       std::shared_ptr<hicache::Copier> copier = nullptr) {
  hicache::HostPrefixCache cache(pool.segments(), kGpu, config(64), copier);
  std::vector<std::vector<std::uint8_t>> before;
  for (std::int64_t b = 0; b < pages; ++b) before.push_back(pool.page(b));
  const auto prompt = tokens(static_cast<std::size_t>(pages * 128 + 1));
  EXPECT_EQ(cache.store("a", prompt, ids(0, pages + 1), stream), pages) << cache.stats().last_error;
  drain(cache);
  for (std::int64_t b = 0; b < pages; ++b) pool.clear(32 + b);
  EXPECT_EQ(cache.try_resume("b", prompt, give(32), stream), pages * 128);
  drain(cache);
  for (std::int64_t b = 0; b < pages; ++b) {
    EXPECT_EQ(pool.page(32 + b), before[static_cast<std::size_t>(b)]) << "page " << b;
  }
}

}  // namespace

TEST(CudaCopier, PageMajorRandomBytesRoundTripOnDmaAndOnTheKernel) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  DevicePool pool(64, {1 << 20});
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  expect_round_trip(pool, 12, s);        // 1 MiB chunks: the DMA engines by default
  expect_round_trip(pool, 12, nullptr);  // the legacy stream, which the DMA batch API refuses
  expect_round_trip(pool, 12, s, hicache::make_cuda_copier(0, kKernelOnly));
  cudaStreamDestroy(s);
}

TEST(CudaCopier, DmaRunsOfAdjacentSlotsAndBlocksCopyAsOnePieceAndRoundTrip) {
  // A page-major pool's pages whose host slots and engine blocks both follow each other go as
  // one piece (dma_pieces.hpp): a store of 300 pages in order (a run longer than one DMA batch,
  // across the host pool's first chunk boundary, where the pool's gap keeps it two pieces), then
  // a load of them back into other blocks with both sides running backwards. Every byte must
  // land where a piece a page would put it.
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  constexpr std::int64_t n = 300;
  DevicePool pool(2 * n, {256 << 10});
  hicache::PageLayout layout(pool.segments(), kGpu);
  auto copier = bound_copier(layout, forced(hicache::CopyPath::kDma));
  ASSERT_STREQ(copier->path(), "dma");
  auto host = host_slots(layout, *copier, n);  // 64 MiB chunks: 256 slots each
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  std::vector<hicache::PageMove> out, in;
  for (std::int64_t i = 0; i < n; ++i) out.push_back({i, host.slot(i)});
  for (std::int64_t i = 0; i < n; ++i) in.push_back({2 * n - 1 - i, host.slot(n - 1 - i)});
  for (std::int64_t i = n; i < 2 * n; ++i) pool.clear(i);
  copier->copy_pages(hicache::Direction::kToHost, layout, out, s);
  copier->record(s)->wait();
  for (std::int64_t i = 0; i < n; ++i) {
    const auto page = pool.page(i);
    ASSERT_TRUE(
        std::equal(page.begin(), page.end(), reinterpret_cast<const std::uint8_t*>(host.slot(i))))
        << "host copy of page " << i;
  }
  copier->copy_pages(hicache::Direction::kToDevice, layout, in, s);
  copier->record(s)->wait();
  for (std::int64_t i = 0; i < n; ++i) ASSERT_EQ(pool.page(n + i), pool.page(i)) << "page " << i;
  cudaStreamDestroy(s);
}

TEST(CudaCopier, AStoreIntoFreedSlotsTakesThemInTheBlocksOrderAndRoundTrips) {
  // The DMA path on one-segment pages joins runs (Copier::joins_runs), so a store into a full
  // pool gets the slots its evictions freed (leaf first: backwards) in its blocks' order
  // (slot_order.hpp). The bytes must come back whole; the other paths and several segments do
  // not ask for it.
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  DevicePool pool(24, {1 << 20});
  {
    hicache::PageLayout layout(pool.segments(), kGpu);
    EXPECT_TRUE(bound_copier(layout, {})->joins_runs(layout));
    EXPECT_FALSE(bound_copier(layout, kKernelOnly)->joins_runs(layout));
    DevicePool two(4, {1 << 20, 1 << 20});
    hicache::PageLayout layout2(two.segments(), kGpu);
    EXPECT_FALSE(bound_copier(layout2, {})->joins_runs(layout2));
  }
  hicache::CacheConfig c = config(8);
  c.admission = hicache::Admission::kAlways;
  hicache::HostPrefixCache cache(pool.segments(), kGpu, c);
  ASSERT_STREQ(cache.copy_path(), "dma");
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  EXPECT_EQ(cache.store("a", tokens(8 * 128 + 1), ids(0, 8), s), 8);
  drain(cache);
  cache.forget("a");
  const auto b = tokens(8 * 128 + 1, 5000);
  EXPECT_EQ(cache.store("b", b, ids(8, 8), s), 8);  // every page evicts one of a's
  drain(cache);
  cache.forget("b");
  EXPECT_EQ(cache.stats().pages_evicted, 8);
  for (std::int64_t i = 16; i < 24; ++i) pool.clear(i);
  EXPECT_EQ(cache.try_resume("c", b, give(16), s), 8 * 128);
  drain(cache);
  for (std::int64_t i = 0; i < 8; ++i) EXPECT_EQ(pool.page(16 + i), pool.page(8 + i)) << i;
  cudaStreamDestroy(s);
}

TEST(CudaCopier, DmaPiecesOnTheLegacyStreamKeepItsOrder) {
  // The batched DMA API refuses the legacy default stream (torch's current stream unless the
  // engine set one): a DMA-path call on it goes on a stream of the copier's own, ordered after
  // the legacy stream's earlier work and before its later work. Behind a running kernel: a store
  // reads block 0 after the engine's write of it and block 1 (its last piece) before the
  // engine's later write; a load lands in block 0 after the engine's earlier write and in
  // block 1 (its last piece) before the engine's later write. Unordered either way, block 0 or
  // block 1 would show the other write.
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  constexpr std::int64_t kPages = 8;
  DevicePool pool(kPages, {1 << 20});
  hicache::PageLayout layout(pool.segments(), kGpu);
  auto copier = bound_copier(layout, {});
  ASSERT_STREQ(copier->path(), "dma");
  auto host = host_slots(layout, *copier, kPages);
  std::vector<hicache::PageMove> moves;
  // Blocks 7..2 (one piece: slots and blocks run backwards together), then 0 and 1 (another:
  // forwards), so block 1 is in the last piece.
  for (std::int64_t i = kPages - 1; i >= 0; --i) moves.push_back({i, host.slot(i)});
  std::swap(moves[kPages - 2], moves.back());
  const auto block1 = pool.page(1);
  auto all = [](const std::vector<std::uint8_t>& v, std::uint8_t b) {
    return std::all_of(v.begin(), v.end(), [b](std::uint8_t x) { return x == b; });
  };
  cudaStream_t legacy = nullptr;
  // The copy on the legacy stream behind a running kernel, between two writes of the engine's
  // there: block 0 before it, block 1 after it.
  auto between_writes = [&](hicache::Direction dir) {
    spin<<<1, 1, 0, legacy>>>(kSpinCycles / 8);
    CK(cudaGetLastError());
    pool.set_async(0, 0x3C, legacy);
    copier->copy_pages(dir, layout, moves, legacy);
    pool.set_async(1, 0x77, legacy);
    copier->record(legacy)->wait();
  };
  between_writes(hicache::Direction::kToHost);
  const auto* slot0 = reinterpret_cast<const std::uint8_t*>(host.slot(0));
  const auto* slot1 = reinterpret_cast<const std::uint8_t*>(host.slot(1));
  EXPECT_TRUE(all({slot0, slot0 + (1 << 20)}, 0x3C)) << "the store read block 0 before its write";
  EXPECT_TRUE(std::equal(block1.begin(), block1.end(), slot1)) << "the store read block 1 late";
  for (std::int64_t i = 2; i < kPages; ++i) {
    const auto page = pool.page(i);
    EXPECT_TRUE(
        std::equal(page.begin(), page.end(), reinterpret_cast<const std::uint8_t*>(host.slot(i))))
        << "page " << i;
  }
  // Loads: every slot back into its block, between two writes of the engine's.
  std::memset(host.slot(0), 0xA5, 1 << 20);
  std::memset(host.slot(1), 0xB6, 1 << 20);
  between_writes(hicache::Direction::kToDevice);
  EXPECT_TRUE(all(pool.page(0), 0xA5)) << "the load landed in block 0 before the engine's write";
  EXPECT_TRUE(all(pool.page(1), 0x77)) << "the load landed in block 1 after the engine's write";
}

TEST(CudaCopier, ThePathFollowsTheLayout) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  auto path_for = [](const DevicePool& pool, hicache::CudaCopierOptions opt = {}) {
    const hicache::PageLayout layout(pool.segments(), kGpu);
    return std::string(bound_copier(layout, opt)->path());
  };
  DevicePool large_chunks(4, {1 << 20, 1 << 20});                       // chunks >= 1 MiB
  DevicePool few_chunks(4, {256 << 10, 256 << 10});                     // two >= 128 KiB
  DevicePool three_chunks(4, std::vector<std::int64_t>(3, 256 << 10));  // three: a page of 768 KiB
  DevicePool layer_major(4, std::vector<std::int64_t>(8, 64 << 10));    // 512 KiB pages
  DevicePool one_mid(4, {128 << 10});               // one 128 KiB chunk: too small a page for DMA
  DevicePool small_pages(4, {32 << 10, 32 << 10});  // 64 KiB pages
  EXPECT_EQ(path_for(large_chunks), "dma");
  EXPECT_EQ(path_for(few_chunks), "dma");
  EXPECT_EQ(path_for(three_chunks), "staged");
  EXPECT_EQ(path_for(layer_major), "staged");
  EXPECT_EQ(path_for(one_mid), "kernel");
  EXPECT_EQ(path_for(small_pages), "kernel");
  EXPECT_EQ(path_for(layer_major, kKernelOnly), "kernel");
  EXPECT_EQ(path_for(small_pages, staged(16 << 20)), "staged");
  EXPECT_EQ(path_for(layer_major, forced(hicache::CopyPath::kDma)), "dma");
  EXPECT_EQ(path_for(layer_major, forced(hicache::CopyPath::kAuto, 0)), "kernel");  // no staging
}

TEST(CudaCopier, StagedPathRoundTripsThroughEveryWindowShape) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  // Small pages keep this fast under compute-sanitizer: 16 chunks of 4 KiB, 64 KiB pages.
  DevicePool pool(40, std::vector<std::int64_t>(16, 4 << 10), 512);
  // Windows of several pages (and a last, partial window); of exactly one page; of a quarter
  // page (widened to one page); the legacy stream; the kernel-only path for reference.
  for (std::size_t staging :
       {std::size_t{768} << 10, std::size_t{128} << 10, std::size_t{32} << 10}) {
    SCOPED_TRACE(staging);
    expect_copier_round_trip(pool, staged(staging), 19, s, s);
    expect_copier_round_trip(pool, staged(staging), 7, nullptr, nullptr);
    expect_copier_round_trip(pool, staged(staging), 19, s, s, Slots::kBackwards);
  }
  expect_copier_round_trip(pool, kKernelOnly, 19, s, s);
  // Every chunk on the DMA engines, pieces far below its sweet spot.
  expect_copier_round_trip(pool, forced(hicache::CopyPath::kDma), 19, s, s);
  // Segments of unequal sizes, the page larger than a window: the window widens to hold it.
  DevicePool uneven(24, {12 << 10, 50 << 10, 6 << 10, 20 << 10});
  expect_copier_round_trip(uneven, staged(64 << 10), 11, s, s);
  cudaStreamDestroy(s);
}

TEST(CudaCopier, StagedWindowsThatGrowWithinACallAndAcrossCallsRoundTrip) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  // 64 KiB pages and 64 MiB of staging: a call's first window holds 128 pages (8 MiB), later
  // ones grow to 512 (32 MiB), and a load's last ones shrink again. A store of 1500 pages goes
  // in windows of 128, 256, 512, 512 and 92 pages.
  DevicePool pool(3000, std::vector<std::int64_t>(16, 4 << 10));
  const auto opt = staged(std::size_t{64} << 20);
  expect_copier_round_trip(pool, opt, 1500, s, s);
  expect_copier_round_trip(pool, opt, 1500, s, s, Slots::kBackwards);
  // In calls of 16, 32, 64... pages back to back: each call after the first finds the lane's
  // DMA running and goes on growing.
  expect_copier_round_trip(pool, opt, 1500, s, s, Slots::kShuffled, 16);
  cudaStreamDestroy(s);
}

TEST(CudaCopier, StagingThatCannotBeAllocatedFallsBackToTheKernel) {
  // 2 TiB of staging cannot be had: copies still happen, through the kernel. (Not run under
  // compute-sanitizer, which reports the refused cudaMalloc as an error.)
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  DevicePool pool(40, std::vector<std::int64_t>(16, 4 << 10));
  expect_copier_round_trip(pool, staged(std::size_t{2} << 40), 9, nullptr, nullptr);
}

TEST(CudaCopier, StagedStoreAndLoadAtOnceOnTwoStreams) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  cudaStream_t a, b;
  CK(cudaStreamCreateWithFlags(&a, cudaStreamNonBlocking));
  CK(cudaStreamCreateWithFlags(&b, cudaStreamNonBlocking));
  DevicePool pool(64, std::vector<std::int64_t>(8, 16 << 10));  // 128 KiB pages
  hicache::PageLayout layout(pool.segments(), kGpu);
  {
    auto copier = bound_copier(layout, staged(512 << 10));  // two pages a window
    auto host = host_slots(layout, *copier, 32);
    std::vector<hicache::PageMove> first, reload, second;
    for (std::int64_t i = 0; i < 16; ++i) {
      first.push_back({i, host.slot(i)});
      reload.push_back({32 + i, host.slot(i)});
      second.push_back({16 + i, host.slot(16 + i)});
    }
    copier->copy_pages(hicache::Direction::kToHost, layout, first, a);
    copier->record(a)->wait();
    // Now, at the same time: pages 16..31 go out on stream a while slots 0..15 come back on b.
    for (int round = 0; round < 3; ++round) {
      for (std::int64_t i = 0; i < 16; ++i) pool.clear(32 + i);
      copier->copy_pages(hicache::Direction::kToHost, layout, second, a);
      copier->copy_pages(hicache::Direction::kToDevice, layout, reload, b);
      auto fa = copier->record(a);
      auto fb = copier->record(b);
      fa->wait();
      fb->wait();
      for (std::int64_t i = 0; i < 16; ++i) {
        ASSERT_EQ(pool.page(32 + i), pool.page(i)) << "round " << round << " page " << i;
        const auto expect = pool.page(16 + i);
        ASSERT_TRUE(std::equal(expect.begin(), expect.end(),
                               reinterpret_cast<const std::uint8_t*>(host.slot(16 + i))));
      }
    }
  }
  cudaStreamDestroy(a);
  cudaStreamDestroy(b);
}

TEST(CudaCopier, StagedStoresReadTheBlocksAfterTheEnginesEarlierWork) {
  // The engine writes its blocks (behind a long kernel) and then stores them on the same
  // stream: what reaches the host is what it wrote.
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  DevicePool pool(16, std::vector<std::int64_t>(8, 16 << 10));
  hicache::PageLayout layout(pool.segments(), kGpu);
  {
    auto copier = bound_copier(layout, staged(256 << 10));
    auto host = host_slots(layout, *copier, 4);
    std::vector<hicache::PageMove> out;
    for (std::int64_t i = 0; i < 4; ++i) out.push_back({i, host.slot(i)});
    const int value = 0x3C;
    spin<<<1, 1, 0, s>>>(kSpinCycles / 4);
    CK(cudaGetLastError());
    for (const auto& m : out) pool.set_async(m.block, value, s);
    copier->copy_pages(hicache::Direction::kToHost, layout, out, s);
    copier->record(s)->wait();
    for (const auto& m : out) {
      const auto* p = reinterpret_cast<const std::uint8_t*>(m.host);
      EXPECT_TRUE(
          std::all_of(p, p + layout.page_bytes(), [&](std::uint8_t b) { return b == value; }));
    }
  }
  cudaStreamDestroy(s);
}

TEST(CudaCopier, StoresAndLoadsSumTheirPagesOnTheDeviceAsTheCpuDoes) {
  // A store asked for its pages' checksums (PageMove::sum_at_fence, as a cache with a tier asks)
  // has the device write them by its fence, each equal to the CPU's page_checksum of the bytes
  // stored, on every path, after the engine's earlier work on the stream (a kernel still running
  // when the store is enqueued, then a write of page 0). A load asked for them (a cache checking
  // pages it fetched from a tier) has them written of the bytes as they landed: into blocks
  // cleared first, behind a running kernel and a write of block 0, so sums taken before the copy
  // landed would be of zeros or of that write. Layouts the device cannot sum say so.
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  struct Case {
    const char* what;
    std::vector<std::int64_t> bytes;
    std::int64_t pages;
    hicache::CudaCopierOptions opt;
    const char* path;
  };
  const std::vector<Case> cases = {
      {"layer-major, more pages than a launch takes",
       std::vector<std::int64_t>(32, 16 << 10),
       300,
       {},
       "staged"},
      {"page-major 1 MiB", {1 << 20}, 24, {}, "dma"},
      {"small pages ending in 1000 bytes (stripes, then bytes)",
       {4096, 4096, 1000},
       260,
       kKernelOnly,
       "kernel"},
      {"one segment of 16 KiB + 72 bytes", {(16 << 10) + 72}, 8, {}, "kernel"},
      // A page's blocks are summed 64 at a time across its segments: chunks that start and end
      // inside segments, and a page of many chunks.
      {"30 segments of 3 KiB", std::vector<std::int64_t>(30, 3 << 10), 40, {}, "kernel"},
      {"page-major 8 MiB + 8 bytes", {(8 << 20) + 8}, 3, {}, "dma"},
  };
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  for (const Case& k : cases) {
    SCOPED_TRACE(k.what);
    DevicePool pool(k.pages, k.bytes);
    hicache::PageLayout layout(pool.segments(), kGpu);
    auto copier = bound_copier(layout, k.opt);
    EXPECT_STREQ(copier->path(), k.path);
    ASSERT_TRUE(copier->sums_on_device(layout));
    auto host = host_slots(layout, *copier, k.pages);
    auto memory = copier->host_allocator();
    const std::size_t sum_bytes = static_cast<std::size_t>(k.pages) * sizeof(std::uint64_t);
    auto* sums = static_cast<std::uint64_t*>(memory->allocate(sum_bytes));
    std::fill(sums, sums + k.pages, 0);
    std::vector<hicache::PageMove> out;
    for (std::int64_t i = 0; i < k.pages; ++i) {
      out.push_back({i, host.slot(k.pages - 1 - i)});
      out.back().sum_at_fence = sums + i;
    }
    spin<<<1, 1, 0, s>>>(kSpinCycles / 8);
    CK(cudaGetLastError());
    pool.set_async(0, 0x3C, s);
    copier->copy_pages(hicache::Direction::kToHost, layout, out, s);
    copier->record(s)->wait();
    const auto page_bytes = static_cast<std::size_t>(layout.page_bytes());
    for (std::int64_t i = 0; i < k.pages; ++i) {
      const auto expect = pool.page(i);
      const auto* got = out[static_cast<std::size_t>(i)].host;
      ASSERT_TRUE(
          std::equal(expect.begin(), expect.end(), reinterpret_cast<const std::uint8_t*>(got)))
          << "page " << i;
      ASSERT_EQ(sums[i], hicache::page_checksum({got, page_bytes})) << "page " << i;
    }
    const auto written = pool.page(0);  // the store read it after the engine's write
    EXPECT_TRUE(
        std::all_of(written.begin(), written.end(), [](std::uint8_t b) { return b == 0x3C; }));
    // Loads: the same pages back from their host slots, into blocks cleared first.
    auto* loaded = static_cast<std::uint64_t*>(memory->allocate(sum_bytes));
    std::fill(loaded, loaded + k.pages, 0);
    for (std::int64_t i = 0; i < k.pages; ++i) {
      pool.clear(i);
      out[static_cast<std::size_t>(i)].sum_at_fence = loaded + i;
    }
    spin<<<1, 1, 0, s>>>(kSpinCycles / 8);
    CK(cudaGetLastError());
    pool.set_async(0, 0x5A, s);
    copier->copy_pages(hicache::Direction::kToDevice, layout, out, s);
    copier->record(s)->wait();
    for (std::int64_t i = 0; i < k.pages; ++i) {
      const auto* host_page =
          reinterpret_cast<const std::uint8_t*>(out[static_cast<std::size_t>(i)].host);
      const auto landed = pool.page(i);
      ASSERT_TRUE(std::equal(landed.begin(), landed.end(), host_page)) << "page " << i;
      ASSERT_EQ(loaded[i], sums[i]) << "page " << i;
    }
    memory->deallocate(loaded, sum_bytes);
    memory->deallocate(sums, sum_bytes);
  }
  cudaStreamDestroy(s);
  // Segments the checksum's blocks would straddle, and blocks 4 bytes apart: not summed here.
  DevicePool straddling(4, {1000, 1048});
  DevicePool misaligned(4, {4096}, /*pad=*/4);
  for (DevicePool* pool : {&straddling, &misaligned}) {
    hicache::PageLayout layout(pool->segments(), kGpu);
    EXPECT_FALSE(bound_copier(layout, {})->sums_on_device(layout));
  }
}

TEST(CudaCopier, StagedLoadsQueuedBehindABusyStreamDoNotHoldUpOtherStreams) {
  // A load on a stream stuck behind a long kernel holds its staging windows and lands after the
  // work queued before it; a load on another stream, enqueued later, has its own staging and
  // completes first; both are right.
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  cudaStream_t busy, free_stream;
  CK(cudaStreamCreateWithFlags(&busy, cudaStreamNonBlocking));
  CK(cudaStreamCreateWithFlags(&free_stream, cudaStreamNonBlocking));
  DevicePool pool(64, std::vector<std::int64_t>(8, 16 << 10));
  hicache::PageLayout layout(pool.segments(), kGpu);
  {
    auto copier = bound_copier(layout, staged(256 << 10));  // a page a window
    auto host = host_slots(layout, *copier, 16);
    std::vector<hicache::PageMove> out, to_busy, to_free;
    for (std::int64_t i = 0; i < 8; ++i) {
      out.push_back({i, host.slot(i)});
      to_busy.push_back({16 + i, host.slot(i)});
      to_free.push_back({32 + i, host.slot(i)});
    }
    copier->copy_pages(hicache::Direction::kToHost, layout, out, free_stream);
    copier->record(free_stream)->wait();
    for (std::int64_t i = 0; i < 8; ++i) {
      pool.clear(16 + i);
      pool.clear(32 + i);
    }
    spin<<<1, 1, 0, busy>>>(kSpinCycles);
    CK(cudaGetLastError());
    // Earlier work of the engine on the same blocks, queued behind the spin: the load must land
    // after it.
    for (const auto& m : to_busy) pool.set_async(m.block, 0xEE, busy);
    copier->copy_pages(hicache::Direction::kToDevice, layout, to_busy, busy);
    auto on_busy = copier->record(busy);
    copier->copy_pages(hicache::Direction::kToDevice, layout, to_free, free_stream);
    auto on_free = copier->record(free_stream);
    on_free->wait();
    EXPECT_FALSE(on_busy->done()) << "the load on the free stream waited for the busy one";
    on_busy->wait();
    for (std::int64_t i = 0; i < 8; ++i) {
      EXPECT_EQ(pool.page(16 + i), pool.page(i)) << "busy stream, page " << i;
      EXPECT_EQ(pool.page(32 + i), pool.page(i)) << "free stream, page " << i;
    }
  }
  cudaStreamDestroy(busy);
  cudaStreamDestroy(free_stream);
}

TEST(CudaCopier, LayerMajorManySegmentsRoundTrip) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  DevicePool pool(64, std::vector<std::int64_t>(48, 16 << 10), 4096);
  expect_round_trip(pool, 9, nullptr);
}

TEST(CudaCopier, UnalignedSegmentsUseNarrowerVectorsAndStillRoundTrip) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  DevicePool four(64, {1000, 20004, 36}, 8);  // multiples of 4: 4-byte path
  expect_round_trip(four, 5, nullptr);
  DevicePool one(64, {1001, 333}, 1);  // odd sizes: byte path
  expect_round_trip(one, 5, nullptr);
}

TEST(CudaCopier, NonDefaultStreamWhileAnotherKernelRuns) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  cudaStream_t busy, mine;
  CK(cudaStreamCreateWithFlags(&busy, cudaStreamNonBlocking));
  CK(cudaStreamCreateWithFlags(&mine, cudaStreamNonBlocking));
  spin<<<8, 32, 0, busy>>>(kSpinCycles);
  DevicePool pool(64, std::vector<std::int64_t>(8, 64 << 10));
  expect_round_trip(pool, 10, mine);
  CK(cudaStreamSynchronize(busy));
  cudaStreamDestroy(busy);
  cudaStreamDestroy(mine);
}

TEST(CudaCopier, InFlightStoresAreNotHitAndNotEvicted) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  DevicePool pool(16, {256 << 10});
  hicache::HostPrefixCache cache(pool.segments(), kGpu, config(2));
  cache.store("w", tokens(257, 5000), ids(6, 3), s);  // pins the pool's chunk
  drain(cache);
  spin<<<1, 1, 0, s>>>(kSpinCycles);  // the copies queue behind this
  CK(cudaGetLastError());
  const auto a = tokens(257), b = tokens(257, 9000);
  EXPECT_EQ(cache.store("a", a, ids(0, 3), s), 2);
  ASSERT_EQ(cudaStreamQuery(s), cudaErrorNotReady) << "the spin kernel ended too early";
  EXPECT_EQ(cache.poll(), 0);
  EXPECT_EQ(cache.try_resume("x", a, give(8), s), 0);
  EXPECT_EQ(cache.store("b", b, ids(3, 3), s), 0);  // both slots held by the copy in flight
  EXPECT_EQ(cache.stats().pages_busy, 2);
  ASSERT_EQ(cudaStreamQuery(s), cudaErrorNotReady) << "the spin kernel ended too early";
  CK(cudaStreamSynchronize(s));
  EXPECT_EQ(cache.poll(), 1);
  EXPECT_EQ(cache.try_resume("y", a, give(8), s), 256);
  CK(cudaStreamSynchronize(s));
  cache.poll();
  EXPECT_EQ(cache.store("b", b, ids(3, 3), s), 2);  // idle now: evicted
  EXPECT_EQ(cache.stats().pages_evicted, 4);        // w's two pages, then a's
  drain(cache);
  EXPECT_EQ(pool.page(8), pool.page(0));
  cudaStreamDestroy(s);
}

TEST(CudaCopier, PollRetiresEachStreamIndependently) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  cudaStream_t slow, fast;
  CK(cudaStreamCreateWithFlags(&slow, cudaStreamNonBlocking));
  CK(cudaStreamCreateWithFlags(&fast, cudaStreamNonBlocking));
  DevicePool pool(16, {64 << 10});
  hicache::HostPrefixCache cache(pool.segments(), kGpu, config(8));
  cache.store("w", tokens(129, 7000), ids(12, 2), fast);  // pins the pool's chunk
  drain(cache);
  spin<<<1, 1, 0, slow>>>(kSpinCycles);
  CK(cudaGetLastError());
  cache.store("a", tokens(129), ids(0, 2), slow);
  cache.store("b", tokens(129, 500), ids(2, 2), fast);
  CK(cudaStreamSynchronize(fast));
  ASSERT_EQ(cudaStreamQuery(slow), cudaErrorNotReady) << "the spin kernel ended too early";
  EXPECT_EQ(cache.poll(), 1);  // the later transfer completed first
  EXPECT_EQ(cache.try_resume("c", tokens(129, 500), give(8), fast), 128);
  EXPECT_EQ(cache.try_resume("d", tokens(129), give(9), fast), 0);
  CK(cudaStreamSynchronize(slow));
  EXPECT_EQ(cache.try_resume("e", tokens(129), give(9), fast), 128);
  drain(cache);
  cudaStreamDestroy(slow);
  cudaStreamDestroy(fast);
}

TEST(CudaCopier, StoresNeverWaitForTheEnginesStream) {
  // A store must never make the engine's thread wait for work already queued on the GPU (the
  // copy kernels are loaded when the cache is built: CUDA's lazy loading would otherwise wait
  // for running kernels at the first launch), on the kernel path (64 KiB pages), the staged
  // path (1 MiB layer-major pages of 64 KiB chunks, whose staging is allocated at the first
  // store) and the DMA path (1 MiB chunks).
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  for (const auto& chunks :
       {std::vector<std::int64_t>{64 << 10}, std::vector<std::int64_t>(16, 64 << 10),
        std::vector<std::int64_t>(2, 1 << 20)}) {
    SCOPED_TRACE(chunks.size());
    DevicePool pool(16, chunks);
    std::int64_t page = 0;
    for (std::int64_t b : chunks) page += b;
    hicache::CacheConfig c = config(8);
    c.pool_chunk_bytes = static_cast<std::size_t>(2 * page);  // two pages a chunk, four chunks
    c.pin_upfront = true;
    hicache::HostPrefixCache cache(pool.segments(), kGpu, c);
    EXPECT_EQ(cache.stats().host_bytes, 8 * page);
    spin<<<1, 1, 0, s>>>(kSpinCycles);
    CK(cudaGetLastError());
    const auto t0 = std::chrono::steady_clock::now();
    EXPECT_EQ(cache.store("a", tokens(4 * 128 + 1), ids(0, 5), s), 4);
    const double ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    EXPECT_EQ(cudaStreamQuery(s), cudaErrorNotReady) << "store took " << ms << " ms";
    EXPECT_LT(ms, 30.0);
    drain(cache);
    EXPECT_EQ(cache.try_resume("b", tokens(4 * 128 + 1), give(8), s), 4 * 128);
    drain(cache);
    EXPECT_EQ(pool.page(11), pool.page(3));
  }
  cudaStreamDestroy(s);
}

TEST(CudaCopier, ThePoolIsPinnedInTheBackgroundWhileTheGpuIsBusy) {
  // Pinning does not wait for the GPU: a pool of four chunks is whole while a long kernel still
  // runs, and a store of more than a chunk queued behind that kernel is not cut short.
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  DevicePool pool(16, {256 << 10});
  hicache::CacheConfig c = config(8);
  c.pool_chunk_bytes = 512 << 10;  // two pages a chunk
  c.pin_upfront = false;
  // The first cache of a process loads hicache's kernels, and with CUDA's lazy module loading
  // (the default) loading a module waits until the device's running work ends: measured on an
  // H200, a cache built beside a 2 s kernel took 2.02 s. That is start-up's cost, once; pinning
  // itself does not wait, which is what this test checks: the kernels are loaded first.
  {
    hicache::HostPrefixCache warm(pool.segments(), kGpu, c);
  }
  // About 1 s at 2 GHz: far longer than pinning 2 MiB takes.
  spin<<<1, 1, 0, s>>>(10 * kSpinCycles);
  CK(cudaGetLastError());
  const auto t0 = std::chrono::steady_clock::now();
  const auto ms = [&] {
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  };
  hicache::HostPrefixCache cache(pool.segments(), kGpu, c);
  const double built = ms();
  EXPECT_GE(cache.stats().host_bytes, 2 * (256 << 10));  // the first chunk, by the constructor
  for (int i = 0; i < 2000 && cache.stats().host_bytes < 8 * (256 << 10); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  const double whole = ms();
  std::printf("cache built in %.1f ms, pool whole at %.1f ms, beside a busy GPU\n", built, whole);
  EXPECT_EQ(cache.stats().host_bytes, 8 * (256 << 10));
  EXPECT_EQ(cache.stats().pinning, "whole");
  ASSERT_EQ(cudaStreamQuery(s), cudaErrorNotReady) << "the spin kernel ended too early";
  EXPECT_EQ(cache.store("a", tokens(5 * 128 + 1), ids(0, 6), s), 5);  // three chunks' worth
  EXPECT_EQ(cache.stats().store_skips_unpinned, 0);
  drain(cache);
  EXPECT_EQ(cache.try_resume("b", tokens(5 * 128 + 1), give(8), s), 5 * 128);
  drain(cache);
  EXPECT_EQ(pool.page(12), pool.page(4));
  cudaStreamDestroy(s);
}

TEST(CudaCopier, StateGoesThroughADeviceStagingBuffer) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  DevicePool pool(16, {64 << 10});
  hicache::CacheConfig c = config(8);
  c.state_bytes = 4096;
  c.capacity_states = 4;
  hicache::HostPrefixCache cache(pool.segments(), kGpu, c);
  void* staging = nullptr;
  CK(cudaMalloc(&staging, 4096));
  std::vector<std::uint8_t> expect(4096);
  for (std::size_t i = 0; i < expect.size(); ++i) expect[i] = static_cast<std::uint8_t>(i * 7);
  auto exporter = [&](std::int64_t pos) -> std::optional<hicache::DeviceBuffer> {
    if (pos != 256) return std::nullopt;
    cudaMemcpy(staging, expect.data(), expect.size(), cudaMemcpyHostToDevice);
    return hicache::DeviceBuffer{staging, 4096, kGpu};
  };
  cache.store("a", tokens(300), ids(0, 3), nullptr, exporter);
  drain(cache);
  CK(cudaMemset(staging, 0, 4096));
  EXPECT_EQ(cache.try_resume("b", tokens(300), give(8), nullptr,
                             hicache::DeviceBuffer{staging, 4096, kGpu}),
            256);
  drain(cache);
  std::vector<std::uint8_t> got(4096);
  CK(cudaMemcpy(got.data(), staging, got.size(), cudaMemcpyDeviceToHost));
  EXPECT_EQ(got, expect);
  cudaFree(staging);
}

TEST(CudaCopier, BadBlockIdsAndHostPointersAreRejectedBeforeAnyLaunch) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  DevicePool pool(8, {4096});
  hicache::HostPrefixCache cache(pool.segments(), kGpu, config(8));
  cache.store("a", tokens(257), ids(0, 3));
  drain(cache);
  const auto before = pool.page(7);
  auto bad = [](std::int64_t) -> std::optional<std::vector<std::int64_t>> {
    return std::vector<std::int64_t>{7, 8};
  };
  EXPECT_THROW(cache.try_resume("b", tokens(257), bad), std::out_of_range);
  drain(cache);
  EXPECT_EQ(pool.page(7), before);
  std::vector<char> host(8 * 4096);
  std::vector<hicache::Segment> on_host{{host.data(), 8, 4096, 4096}};
  EXPECT_THROW(hicache::HostPrefixCache(on_host, kGpu, config(4)), std::invalid_argument);
  EXPECT_THROW(hicache::make_cuda_copier(99), std::invalid_argument);
}
