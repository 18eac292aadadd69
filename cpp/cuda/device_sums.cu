#include <algorithm>
#include <cstdint>
#include <functional>

#include "../src/page_checksum_def.hpp"
#include "cuda_check.cuh"
#include "device_sums.hpp"

namespace hicache::cuda {
namespace {

namespace def = detail::checksum_def;
using u64 = def::u64;

// A CTA a page. A page's checksum is one chain of scrambles over its kilobyte blocks, but what a
// block adds to a lane before its scramble is a plain sum (accumulate is an add), so eight warps
// add up each block's lanes, 64 blocks (64 KiB) a chunk, while a ninth runs the chain over the
// chunk before (its first eight threads, one a checksum lane), and each loader's next chunk is
// loaded while it waits at the barrier. Eight threads a page that loaded each block themselves,
// one block ahead, made a store of one 8.6 MiB page (MLA, 61 x 144 KiB) take 3.5 ms on an H100
// where its copy took 0.27, and one of 32 pages of 8 MiB 1.8 times its copy. A CTA a page keeps
// stores of many pages within a few percent of their time without the sums, and adds at most 0.07
// ms to a one-page store (bench/research/store_sums.py, BENCHMARKS.md).
constexpr int kLoadWarps = 8;
constexpr int kLoaders = kLoadWarps * 32;
constexpr int kRows = 2;                          // blocks a loader adds up a chunk
constexpr int kRowStep = kLoaders / def::kLanes;  // 32: a loader's rows apart
constexpr int kChunk = kRowStep * kRows;          // 64 blocks a chunk
constexpr int kThreads = kLoaders + 32;           // the loaders and the chain's warp
static_assert(32 % def::kLanes == 0);

struct SumBatch {
  int count;
  long long blocks[DeviceSums::kMaxPagesPerLaunch];
  std::uint64_t* out[DeviceSums::kMaxPagesPerLaunch];
};
static_assert(sizeof(SumBatch) <= 4096);

__device__ __forceinline__ u64 word(const u64* p) {
  return static_cast<u64>(__ldcs(reinterpret_cast<const unsigned long long*>(p)));
}

// Where a page's whole blocks are, one after another across its segments (each segment but the
// last holds whole blocks: can_sum): segment g, block `at` of it.
struct BlockCursor {
  int g = 0;
  long long at = 0;
  __device__ void skip(const SegmentDesc* segs, int nseg, long long n) {
    at += n;
    while (g < nseg) {
      const long long have = segs[g].bytes / static_cast<long long>(def::kBlock);
      if (at < have) return;
      at -= have;
      ++g;
    }
  }
  __device__ const u64* words(const SegmentDesc* segs, long long block) const {
    const SegmentDesc& sg = segs[g];
    return reinterpret_cast<const u64*>(sg.base + block * sg.stride +
                                        at * static_cast<long long>(def::kBlock));
  }
};

__global__ void __launch_bounds__(kThreads)
    page_sum_kernel(const SegmentDesc* __restrict__ segs, int nseg, u64 page_bytes, long long whole,
                    SumBatch batch) {
  __shared__ u64 adds[2][kChunk][def::kLanes];  // a chunk's blocks' sums by lane, two chunks
  const int t = static_cast<int>(threadIdx.x);
  const int lane = t % def::kLanes;
  const bool loader = t < kLoaders;
  const long long block = batch.blocks[blockIdx.x];
  const long long chunks = (whole + kChunk - 1) / kChunk;

  u64 k[def::kStripes];
#pragma unroll
  for (int s = 0; s < def::kStripes; ++s) k[s] = def::secret(s + lane);
  // A loader adds up lane `lane` of rows row0 and row0 + 32 of each chunk (the page's blocks
  // chunk * 64 + row).
  const int row0 = t / def::kLanes;
  BlockCursor at[kRows];
  if (loader) {
#pragma unroll
    for (int r = 0; r < kRows; ++r) at[r].skip(segs, nseg, row0 + r * kRowStep);
  }
  const u64 ks = def::secret(def::kStripes + lane);
  u64 acc = def::secret(lane);  // the chain's (threads kLoaders .. kLoaders + 7)
  // A loader's words of the chunk it adds up next: loaded one chunk ahead, so that the loads
  // cross the barrier and the chain's turn instead of waiting for them.
  u64 w[kRows][def::kStripes] = {};
  const auto load = [&](long long c) {
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      if (c * kChunk + row0 + r * kRowStep < whole) {  // else its sum goes to a row never read
        const u64* p = at[r].words(segs, block) + lane;
#pragma unroll
        for (int s = 0; s < def::kStripes; ++s) w[r][s] = word(p + s * def::kLanes);
      }
      at[r].skip(segs, nseg, kChunk);
    }
  };
  if (loader && chunks > 0) load(0);
  for (long long c = 0; c <= chunks; ++c) {
    if (loader && c < chunks) {
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        u64 sum = 0;
#pragma unroll
        for (int s = 0; s < def::kStripes; ++s) sum = def::accumulate(sum, w[r][s], k[s]);
        adds[c & 1][row0 + r * kRowStep][lane] = sum;
      }
      if (c + 1 < chunks) load(c + 1);
    } else if (!loader && c > 0 && t - kLoaders < def::kLanes) {
      const long long first = (c - 1) * kChunk;
      const int rows = static_cast<int>(min(static_cast<long long>(kChunk), whole - first));
      const u64(&in)[kChunk][def::kLanes] = adds[(c - 1) & 1];
#pragma unroll 8
      for (int row = 0; row < rows; ++row) acc = def::scramble(acc + in[row][lane], ks);
    }
    __syncthreads();  // chunk c's sums are in; the chain is done with chunk c - 1's buffer
  }
  if (loader) return;
  // The last segment's bytes after its whole blocks: its whole stripes (no scramble), then its
  // bytes one at a time after the fold.
  const SegmentDesc& last = segs[nseg - 1];
  const long long last_whole = last.bytes / static_cast<long long>(def::kBlock);
  const long long rest = last.bytes - last_whole * static_cast<long long>(def::kBlock);
  const char* end =
      last.base + block * last.stride + last_whole * static_cast<long long>(def::kBlock);
  const int stripes = static_cast<int>(rest / static_cast<long long>(def::kStripe));
  if (t - kLoaders < def::kLanes) {
    const u64* p = reinterpret_cast<const u64*>(end) + lane;
    for (int s = 0; s < stripes; ++s) acc = def::accumulate(acc, word(p + s * def::kLanes), k[s]);
  }
  // The eight lanes to the warp's first thread.
  u64 lanes[def::kLanes];
#pragma unroll
  for (int i = 0; i < def::kLanes; ++i) {
    lanes[i] = static_cast<u64>(__shfl_sync(0xffffffffu, static_cast<unsigned long long>(acc), i));
  }
  if (t != kLoaders) return;
  u64 h = def::fold(lanes, page_bytes);
  const auto* tail = reinterpret_cast<const unsigned char*>(end) + stripes * def::kStripe;
  for (int i = 0; i < static_cast<int>(rest % static_cast<long long>(def::kStripe)); ++i) {
    h = def::tail_byte(h, tail[i]);
  }
  *batch.out[blockIdx.x] = def::finish(h);
}

}  // namespace

bool DeviceSums::can_sum(const PageLayout& layout) {
  const auto& segs = layout.segments();
  if (segs.empty()) return false;
  for (std::size_t s = 0; s < segs.size(); ++s) {
    if (reinterpret_cast<std::uintptr_t>(segs[s].base) % sizeof(u64) != 0) return false;
    if (segs[s].block_stride % static_cast<std::int64_t>(sizeof(u64)) != 0) return false;
    if (s + 1 < segs.size() && segs[s].block_bytes % static_cast<std::int64_t>(def::kBlock) != 0) {
      return false;
    }
  }
  return true;
}

DeviceSums::DeviceSums(const SegmentDesc* rows, int segments, const PageLayout& layout)
    : rows_(rows), segments_(segments), page_bytes_(static_cast<std::size_t>(layout.page_bytes())) {
  // Every segment but the last is whole blocks (can_sum): the page's whole blocks are the same
  // however the table merged its segments.
  for (const Segment& s : layout.segments()) {
    whole_blocks_ += s.block_bytes / static_cast<std::int64_t>(def::kBlock);
  }
}

DeviceSums::~DeviceSums() {
  // Work queued on a stream still runs after cudaStreamDestroy returns; the copier's owner
  // waited for its transfers' fences, which joined these streams, before it got here.
  for (auto& [caller, ours] : sides_) cudaStreamDestroy(ours);
}

cudaStream_t DeviceSums::side(cudaStream_t s) {
  std::lock_guard<std::mutex> g(mu_);
  for (auto& [caller, ours] : sides_) {
    if (caller == s) return ours;
  }
  if (sides_.size() < kMaxSides) {
    cudaStream_t ours = nullptr;
    HICACHE_CUDA_CHECK(cudaStreamCreateWithFlags(&ours, cudaStreamNonBlocking));
    sides_.emplace_back(s, ours);
    return ours;
  }
  return sides_[std::hash<cudaStream_t>{}(s) % sides_.size()].second;
}

namespace {
bool asks_sums(std::span<const PageMove> moves) {
  return std::any_of(moves.begin(), moves.end(),
                     [](const PageMove& m) { return m.sum_at_fence != nullptr; });
}
}  // namespace

void DeviceSums::launch(std::span<const PageMove> moves, cudaStream_t on) {
  SumBatch batch;
  batch.count = 0;
  auto flush = [&] {
    page_sum_kernel<<<batch.count, kThreads, 0, on>>>(rows_, segments_, page_bytes_, whole_blocks_,
                                                      batch);
    HICACHE_CUDA_CHECK(cudaGetLastError());
    batch.count = 0;
  };
  for (const PageMove& m : moves) {
    if (m.sum_at_fence == nullptr) continue;
    batch.blocks[batch.count] = m.block;
    batch.out[batch.count] = m.sum_at_fence;
    if (++batch.count == kMaxPagesPerLaunch) flush();
  }
  if (batch.count > 0) flush();
}

cudaEvent_t DeviceSums::fork(std::span<const PageMove> moves, cudaStream_t s) {
  if (!asks_sums(moves)) return nullptr;
  cudaStream_t ours = side(s);
  events_.order(s, ours);
  launch(moves, ours);
  cudaEvent_t summed = events_.take();
  if (const cudaError_t e = cudaEventRecord(summed, ours); e != cudaSuccess) {
    events_.give(summed);
    throw_cuda_error(e, "cudaEventRecord", __FILE__, __LINE__);
  }
  return summed;
}

void DeviceSums::after(std::span<const PageMove> moves, cudaStream_t s) {
  if (asks_sums(moves)) launch(moves, s);
}

void DeviceSums::join(cudaEvent_t summed, cudaStream_t s) {
  if (summed == nullptr) return;
  const cudaError_t err = cudaStreamWaitEvent(s, summed, 0);
  events_.give(summed);
  if (err != cudaSuccess) throw_cuda_error(err, "cudaStreamWaitEvent", __FILE__, __LINE__);
}

}  // namespace hicache::cuda
