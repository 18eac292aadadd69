#include <algorithm>

#include "cuda_check.cuh"
#include "segment_table.hpp"

namespace hicache::cuda {
namespace {

template <typename V, bool kToHost>
void launch_one(const SegmentDesc* segs, int nseg, long long tiles_per_page, const MoveBatch& batch,
                int blocks, int threads, cudaStream_t stream) {
  page_copy_kernel<V, kUnroll<V, kToHost>, kToHost>
      <<<blocks, threads, 0, stream>>>(segs, nseg, tiles_per_page, batch);
  HICACHE_CUDA_CHECK(cudaGetLastError());
}

template <typename V>
void load_pair() {
  cudaFuncAttributes a;
  HICACHE_CUDA_CHECK(cudaFuncGetAttributes(&a, page_copy_kernel<V, kUnroll<V, true>, true>));
  HICACHE_CUDA_CHECK(cudaFuncGetAttributes(&a, page_copy_kernel<V, kUnroll<V, false>, false>));
}

}  // namespace

std::vector<SegmentDesc> segment_rows(const PageLayout& layout) {
  const auto& segs = layout.segments();
  std::vector<SegmentDesc> rows;
  rows.reserve(segs.size());
  for (std::size_t s = 0; s < segs.size(); ++s) {
    rows.push_back({static_cast<char*>(segs[s].base), segs[s].block_stride, segs[s].block_bytes,
                    static_cast<long long>(layout.page_offset(s)), 0});
  }
  return rows;
}

SegmentTable::SegmentTable(std::vector<SegmentDesc> table, int vec, int threads)
    : count_(static_cast<int>(table.size())), vec_(vec), threads_(threads) {
  const long long tile = static_cast<long long>(threads) * vec;
  for (SegmentDesc& r : table) {
    r.first_tile = tiles_per_page_;
    tiles_per_page_ += (r.bytes + tile - 1) / tile;
  }
  HICACHE_CUDA_CHECK(cudaMalloc(&rows_, table.size() * sizeof(SegmentDesc)));
  // On a stream of its own: a plain cudaMemcpy runs on the legacy default stream, which may be
  // waiting for a load this table is made for (the load scheduler makes tables at first use).
  cudaStream_t s = nullptr;
  cudaError_t err = cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  if (err == cudaSuccess) {
    err = cudaMemcpyAsync(rows_, table.data(), table.size() * sizeof(SegmentDesc),
                          cudaMemcpyHostToDevice, s);
    if (err == cudaSuccess) err = cudaStreamSynchronize(s);
    cudaStreamDestroy(s);
  }
  if (err != cudaSuccess) {
    cudaFree(rows_);
    throw_cuda_error(err, "cudaMemcpyAsync(segment table)", __FILE__, __LINE__);
  }
}

SegmentTable::~SegmentTable() { cudaFree(rows_); }

void SegmentTable::launch(Direction dir, std::span<const PageMove> moves, int max_blocks,
                          cudaStream_t s) const {
  const bool to_host = dir == Direction::kToHost;
  for (std::size_t first = 0; first < moves.size(); first += kMaxMovesPerLaunch) {
    MoveBatch batch;
    batch.count = static_cast<int>(std::min<std::size_t>(kMaxMovesPerLaunch, moves.size() - first));
    for (int i = 0; i < batch.count; ++i) {
      batch.blocks[i] = moves[first + i].block;
      batch.hosts[i] = reinterpret_cast<char*>(moves[first + i].host);
    }
    const int blocks = launch_ctas(batch.count, tiles_per_page_, max_blocks);
    const int t = threads_;
    if (vec_ == 16) {
      to_host ? launch_one<uint4, true>(rows_, count_, tiles_per_page_, batch, blocks, t, s)
              : launch_one<uint4, false>(rows_, count_, tiles_per_page_, batch, blocks, t, s);
    } else if (vec_ == 4) {
      to_host ? launch_one<unsigned, true>(rows_, count_, tiles_per_page_, batch, blocks, t, s)
              : launch_one<unsigned, false>(rows_, count_, tiles_per_page_, batch, blocks, t, s);
    } else {
      to_host
          ? launch_one<unsigned char, true>(rows_, count_, tiles_per_page_, batch, blocks, t, s)
          : launch_one<unsigned char, false>(rows_, count_, tiles_per_page_, batch, blocks, t, s);
    }
  }
}

void SegmentTable::load_kernels() {
  load_pair<uint4>();
  load_pair<unsigned>();
  load_pair<unsigned char>();
}

}  // namespace hicache::cuda
