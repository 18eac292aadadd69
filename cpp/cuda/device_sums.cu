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

constexpr int kThreads = 128;  // 16 pages a CTA, 4 a warp
static_assert(kThreads % 32 == 0 && 32 % def::kLanes == 0);
constexpr int kWords = static_cast<int>(def::kBlock / sizeof(u64));  // a block's words

struct SumBatch {
  int count;
  long long blocks[DeviceSums::kMaxPagesPerLaunch];
  std::uint64_t* out[DeviceSums::kMaxPagesPerLaunch];
};
static_assert(sizeof(SumBatch) <= 4096);

__device__ __forceinline__ u64 word(const u64* p) {
  return static_cast<u64>(__ldcs(reinterpret_cast<const unsigned long long*>(p)));
}

// Lane `lane`'s words of one whole block (stripe s: word s * 8 + lane), loaded ahead.
__device__ __forceinline__ void load_block(u64 (&v)[def::kStripes], const u64* w) {
#pragma unroll
  for (int s = 0; s < def::kStripes; ++s) v[s] = word(w + s * def::kLanes);
}

// Thread t sums lane t % 8 of page t / 8; the page's first thread folds the lanes and writes the
// checksum to its sum_at_fence. Each thread loads a block ahead of the one it adds up, so 16-32
// loads of each are in flight (a page is one sequential chain).
__global__ void __launch_bounds__(kThreads)
    page_sum_kernel(const SegmentDesc* __restrict__ segs, int nseg, u64 page_bytes,
                    SumBatch batch) {
  const int lane = static_cast<int>(threadIdx.x) % def::kLanes;
  const int page = static_cast<int>((blockIdx.x * blockDim.x + threadIdx.x) / def::kLanes);
  u64 k[def::kStripes];
#pragma unroll
  for (int s = 0; s < def::kStripes; ++s) k[s] = def::secret(s + lane);
  const u64 ks = def::secret(def::kStripes + lane);
  u64 acc = def::secret(lane);
  const unsigned char* tail = nullptr;  // the bytes after the page's last whole stripe
  int tail_bytes = 0;
  if (page < batch.count) {
    const long long block = batch.blocks[page];
    for (int g = 0; g < nseg; ++g) {
      const SegmentDesc sg = segs[g];
      const char* base = sg.base + block * sg.stride;
      const u64* w = reinterpret_cast<const u64*>(base) + lane;
      const long long blocks = sg.bytes / static_cast<long long>(def::kBlock);
      u64 v[def::kStripes], next[def::kStripes];
      if (blocks > 0) load_block(v, w);
      for (long long b = 0; b < blocks; ++b) {
        if (b + 1 < blocks) load_block(next, w + kWords);
#pragma unroll
        for (int s = 0; s < def::kStripes; ++s) acc = def::accumulate(acc, v[s], k[s]);
        acc = def::scramble(acc, ks);
        if (b + 1 < blocks) {
#pragma unroll
          for (int s = 0; s < def::kStripes; ++s) v[s] = next[s];
        }
        w += kWords;
      }
      // Only the last segment ends inside a block (can_sum): its stripes, then its bytes.
      const long long rest = sg.bytes - blocks * static_cast<long long>(def::kBlock);
      if (rest > 0) {
        const int stripes = static_cast<int>(rest / static_cast<long long>(def::kStripe));
#pragma unroll
        for (int s = 0; s < def::kStripes; ++s) {
          if (s < stripes) acc = def::accumulate(acc, word(w + s * def::kLanes), k[s]);
        }
        tail = reinterpret_cast<const unsigned char*>(base) + (sg.bytes - rest % def::kStripe);
        tail_bytes = static_cast<int>(rest % static_cast<long long>(def::kStripe));
      }
    }
  }
  // The page's eight lanes to its first thread (the whole warp takes part in each shuffle).
  u64 lanes[def::kLanes];
  const int first = (static_cast<int>(threadIdx.x) % 32) & ~(def::kLanes - 1);
#pragma unroll
  for (int i = 0; i < def::kLanes; ++i) {
    lanes[i] =
        static_cast<u64>(__shfl_sync(0xffffffffu, static_cast<unsigned long long>(acc), first + i));
  }
  if (page >= batch.count || lane != 0) return;
  u64 h = def::fold(lanes, page_bytes);
  for (int i = 0; i < tail_bytes; ++i) h = def::tail_byte(h, tail[i]);
  *batch.out[page] = def::finish(h);
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

DeviceSums::DeviceSums(const SegmentDesc* rows, int segments, std::size_t page_bytes)
    : rows_(rows), segments_(segments), page_bytes_(page_bytes) {}

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

cudaEvent_t DeviceSums::fork(std::span<const PageMove> moves, cudaStream_t s) {
  const bool asked = std::any_of(moves.begin(), moves.end(),
                                 [](const PageMove& m) { return m.sum_at_fence != nullptr; });
  if (!asked) return nullptr;
  cudaStream_t ours = side(s);
  cudaEvent_t queued = events_.take();
  HICACHE_CUDA_CHECK(cudaEventRecord(queued, s));
  // A wait takes the event as last recorded: it may go back to the pool at once.
  const cudaError_t err = cudaStreamWaitEvent(ours, queued, 0);
  events_.give(queued);
  if (err != cudaSuccess) throw_cuda_error(err, "cudaStreamWaitEvent", __FILE__, __LINE__);
  SumBatch batch;
  batch.count = 0;
  auto launch = [&] {
    const int pages_a_cta = kThreads / def::kLanes;
    const int ctas = (batch.count + pages_a_cta - 1) / pages_a_cta;
    page_sum_kernel<<<ctas, kThreads, 0, ours>>>(rows_, segments_, page_bytes_, batch);
    HICACHE_CUDA_CHECK(cudaGetLastError());
    batch.count = 0;
  };
  for (const PageMove& m : moves) {
    if (m.sum_at_fence == nullptr) continue;
    batch.blocks[batch.count] = m.block;
    batch.out[batch.count] = m.sum_at_fence;
    if (++batch.count == kMaxPagesPerLaunch) launch();
  }
  if (batch.count > 0) launch();
  cudaEvent_t summed = events_.take();
  if (const cudaError_t e = cudaEventRecord(summed, ours); e != cudaSuccess) {
    events_.give(summed);
    throw_cuda_error(e, "cudaEventRecord", __FILE__, __LINE__);
  }
  return summed;
}

void DeviceSums::join(cudaEvent_t summed, cudaStream_t s) {
  if (summed == nullptr) return;
  const cudaError_t err = cudaStreamWaitEvent(s, summed, 0);
  events_.give(summed);
  if (err != cudaSuccess) throw_cuda_error(err, "cudaStreamWaitEvent", __FILE__, __LINE__);
}

}  // namespace hicache::cuda
