// The CUDA copier: CUDA events as fences, pinned mapped host memory for the pools, and one of
// three paths a layout (CopyPath), chosen at bind() unless the options force one:
//  - DMA: every chunk is 1 MiB or more, or pages of 256 KiB or more are one or two chunks of
//    128 KiB or more: each chunk a DMA piece, in cudaMemcpyBatchAsync batches.
//  - staged: pages of 512 KiB or more in smaller chunks (layer-major pools): host pages cross
//    PCIe whole on the DMA engines through a device staging buffer (staging_lane.hpp).
//  - kernel: small pages: the gather/scatter kernel copies across PCIe through UVA pointers.

#include <algorithm>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "cuda_check.cuh"
#include "device_sums.hpp"
#include "dma_batch.hpp"
#include "dma_pieces.hpp"
#include "event_pool.hpp"
#include "hicache/copy_rate.hpp"
#include "hicache/cuda_copier.hpp"
#include "pinned_allocator.hpp"
#include "segment_table.hpp"
#include "staging_lane.hpp"

namespace hicache {
namespace cuda {
namespace {

// The automatic choice (measured on an H200, docs/performance.md: "Which path a layout takes").
// Chunks of 1 MiB and more: the DMA engines, 0.98-0.99 of one contiguous copy. Pages of 256 KiB and
// more in one or two chunks of 128 KiB and more: the DMA engines too, a piece or two a page (1024
// pages through the one-call API, against the path chosen before: stores 0.91-0.97 -> 0.93-0.99,
// loads 0.85-0.96 -> 0.91-0.98, both at once 0.58-0.84 -> 0.58-0.88; the copy half alone both at
// once 0.66-0.91 -> 0.84-0.97); they also keep their rate beside compute, where the kernel slowed a
// bf16 matmul by 14 %. Smaller chunks in pages of 512 KiB and more (layer-major pools): staged,
// 0.96-0.99 alone and 0.85-0.98 both at once; the DMA engines match it alone from 128 KiB chunks
// but a store and a load issued together reach only 0.75-0.91 (the calling thread submits a piece
// a chunk, thousands a call) and the engine's thread spends ~5 ms a GiB submitting: engines whose
// copies run beside heavy compute can choose cuda_path="dma". Smaller pages: the kernel (through
// the one-call API, DMA and staging lost there: a 1024-page store of 128 KiB pages 0.82-0.85 on
// the kernel, 0.63-0.67 on the DMA engines, whose submissions add to the call's CPU work).
constexpr std::size_t kDmaMinChunk = std::size_t{1} << 20;
constexpr std::size_t kDmaMinChunkFewSegments = std::size_t{128} << 10;
constexpr std::size_t kDmaMinPageFewSegments = std::size_t{256} << 10;
constexpr std::size_t kFewSegments = 2;
constexpr std::size_t kStagedMinPage = std::size_t{512} << 10;
// Layer-wise loads: a layer's chunks from this size on cross on the DMA engines (0.93-0.97 of a
// contiguous copy from 128 KiB chunks, BENCHMARKS.md), smaller ones through the kernel.
constexpr std::size_t kLayerDmaMinChunk = std::size_t{128} << 10;

CopyPath choose_path(const PageLayout& layout, const CudaCopierOptions& opt) {
  if (opt.path != CopyPath::kAuto) return opt.path;
  if (layout.segments().empty()) return CopyPath::kDma;  // state only: no pages to copy
  std::int64_t smallest = layout.segments().front().block_bytes;
  for (const auto& sg : layout.segments()) smallest = std::min(smallest, sg.block_bytes);
  if (static_cast<std::size_t>(smallest) >= kDmaMinChunk) return CopyPath::kDma;
  if (layout.segments().size() <= kFewSegments &&
      static_cast<std::size_t>(smallest) >= kDmaMinChunkFewSegments &&
      static_cast<std::size_t>(layout.page_bytes()) >= kDmaMinPageFewSegments) {
    return CopyPath::kDma;
  }
  if (opt.staging_bytes > 0 && layout.page_bytes() >= kStagedMinPage) return CopyPath::kStaged;
  return CopyPath::kKernel;
}

class EventFence final : public Fence {
 public:
  EventFence(std::shared_ptr<EventPool> pool, cudaEvent_t e) : pool_(std::move(pool)), e_(e) {}
  ~EventFence() override { pool_->give(e_); }
  bool done() override {
    const cudaError_t err = cudaEventQuery(e_);
    if (err == cudaSuccess) return true;
    if (err == cudaErrorNotReady) return false;
    throw_cuda_error(err, "cudaEventQuery", __FILE__, __LINE__);
  }
  void wait() noexcept override { cudaEventSynchronize(e_); }
  void enqueue_wait(StreamHandle stream) override {
    HICACHE_CUDA_CHECK(cudaStreamWaitEvent(static_cast<cudaStream_t>(stream), e_, 0));
  }

 private:
  std::shared_ptr<EventPool> pool_;
  cudaEvent_t e_;
};

// Times loads on the device (timing events around each load's copies on its stream), so the
// rate includes what slows the link (a competing copy) and not the engine's work queued before.
// Read when asked; at most kMaxPending loads are timed at once (later ones are not timed).
class LoadTimer {
 public:
  ~LoadTimer() {
    for (auto& p : pending_) {
      events_.give(p.start);
      events_.give(p.end);
    }
  }
  struct Mark {
    cudaEvent_t start = nullptr;
  };
  Mark begin(cudaStream_t s) {
    std::lock_guard<std::mutex> g(mu_);
    if (pending_.size() >= kMaxPending) return {};
    cudaEvent_t e = events_.try_take();
    if (e != nullptr && cudaEventRecord(e, s) != cudaSuccess) {
      cudaGetLastError();
      events_.give(e);
      return {};
    }
    return {e};
  }
  void end(Mark m, cudaStream_t s, std::size_t bytes) {
    if (m.start == nullptr) return;
    std::lock_guard<std::mutex> g(mu_);
    cudaEvent_t e = events_.try_take();
    if (e == nullptr || cudaEventRecord(e, s) != cudaSuccess) {
      cudaGetLastError();
      events_.give(m.start);
      if (e != nullptr) events_.give(e);
      return;
    }
    pending_.push_back({m.start, e, bytes});
  }
  double bytes_per_s() {
    std::lock_guard<std::mutex> g(mu_);
    while (!pending_.empty() && cudaEventQuery(pending_.front().end) == cudaSuccess) {
      Pending p = pending_.front();
      pending_.pop_front();
      float ms = 0;
      if (cudaEventElapsedTime(&ms, p.start, p.end) == cudaSuccess) rate_.add(p.bytes, ms / 1e3);
      cudaGetLastError();
      events_.give(p.start);
      events_.give(p.end);
    }
    cudaGetLastError();  // a cudaErrorNotReady from the query above
    return rate_.bytes_per_s();
  }

 private:
  static constexpr std::size_t kMaxPending = 256;
  struct Pending {
    cudaEvent_t start, end;
    std::size_t bytes;
  };
  EventPool events_{cudaEventDefault};  // timing events; outlives pending_'s return to it
  std::mutex mu_;
  std::deque<Pending> pending_;
  CopyRate rate_;
};

// Loads queued on the DMA engines, and the express lane past them.
//
// The copy engine runs host-to-device copies in the order they were submitted, whatever their
// streams. Measured on an H200 (torch copies): 128 MiB issued on its own stream right after 12 GiB
// in 64 MiB pieces on another waited for all of them (233 ms against 2.5 ms alone), and after
// 2 MiB pieces for the ~44 ms of them the driver had queued. A 1K-token hit requested beside a
// 100K-token one waited for the whole large load (234 ms against 2.6 ms through the cache).
// Holding the large load back and issuing it piece by piece from a thread of our own would need
// the engine's stream to wait for copies not yet issued (cuStreamWaitValue32): tried, and it
// deadlocked whenever the engine's thread made a synchronous copy on that stream (a .cpu() of
// the prompt) before the thread had issued every piece. So a load that would queue behind more
// bytes than its own goes around the queue instead: the gather kernel reads its pages across PCIe
// through UVA pointers, beside the DMA engines.
class DmaBacklog {
 public:
  explicit DmaBacklog(std::shared_ptr<EventPool> events) : events_(std::move(events)) {}
  ~DmaBacklog() {
    for (auto& q : queued_) events_->give(q.done);
  }
  /// Whether a load of `bytes` on `s` should go around the loads other streams queued (more bytes
  /// than its own; a stream's own loads run before it anyway).
  bool passes(std::size_t bytes, cudaStream_t s) {
    std::lock_guard<std::mutex> g(mu_);
    std::erase_if(queued_, [&](const Queued& q) {
      if (cudaEventQuery(q.done) != cudaSuccess) return false;
      events_->give(q.done);
      return true;
    });
    cudaGetLastError();  // a cudaErrorNotReady from the queries
    std::size_t ahead = 0;
    for (const Queued& q : queued_) ahead += q.stream == s ? 0 : q.bytes;
    return ahead > bytes;
  }
  /// A load of `bytes` was queued on the DMA engines on `s`.
  void add(cudaStream_t s, std::size_t bytes) {
    std::lock_guard<std::mutex> g(mu_);
    cudaEvent_t e = events_->try_take();
    if (e == nullptr) return;
    if (cudaEventRecord(e, s) != cudaSuccess) {
      cudaGetLastError();
      events_->give(e);
      return;
    }
    queued_.push_back({e, s, bytes});
  }

 private:
  struct Queued {
    cudaEvent_t done;
    cudaStream_t stream;
    std::size_t bytes;
  };
  std::shared_ptr<EventPool> events_;
  std::mutex mu_;
  std::vector<Queued> queued_;  // a few loads in flight at most
};

class CudaCopier final : public Copier {
 public:
  CudaCopier(int device, CudaCopierOptions opt)
      : device_(device), opt_(opt), events_(std::make_shared<EventPool>()), backlog_(events_) {
    DeviceGuard g(device_);
    int direct = 0;
    HICACHE_CUDA_CHECK(
        cudaDeviceGetAttribute(&direct, cudaDevAttrCanUseHostPointerForRegisteredMem, device_));
    // Registered memory is only usable at its host address when the device says so; memory from
    // cudaHostAlloc is, on every 64-bit UVA platform.
    allocator_ = make_pinned_allocator(direct ? PinMode::kRegister : PinMode::kHostAlloc);
    // The staged path's gathers/scatters move bytes within the GPU's memory. With the 4 CTAs
    // that saturate PCIe they ran no faster than the link (a 64 MiB window copied and then
    // scattered without overlap reached 0.53 of a contiguous copy), so the two-window pipeline
    // stalled; 32 CTAs measured 0.96-0.99 on pages of 4 MiB and more, against 0.93-0.97 with 4.
    // One CTA per SM measured the same alone and better beside compute that holds every SM (a
    // bf16 matmul on an H100): the copy beside it 38-47 GB/s instead of 29-39, the matmul at
    // most 1.3 % slower instead of 4.2 % (docs/performance.md, "The scatter's CTAs beside
    // compute").
    int sms = 0;
    HICACHE_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device_));
    staged_blocks_ = std::max(opt_.max_blocks, sms);
  }

  ~CudaCopier() override {
    // Work queued on it still runs after this returns; the caches using this copier waited for
    // their transfers' fences, which the caller's streams recorded after it.
    if (detour_ != nullptr) cudaStreamDestroy(detour_);
  }
  CudaCopier(const CudaCopier&) = delete;
  CudaCopier& operator=(const CudaCopier&) = delete;

  void bind(const PageLayout& layout) override {
    DeviceGuard g(device_);
    const auto& segs = layout.segments();
    if (segs.size() > static_cast<std::size_t>(kMaxSegments)) {
      throw std::invalid_argument("the CUDA copier takes at most " + std::to_string(kMaxSegments) +
                                  " segments");
    }
    std::size_t align = 16;
    for (std::size_t s = 0; s < segs.size(); ++s) {
      check_on_device(segs[s].base, s, "first block");
      const auto* last = static_cast<const char*>(segs[s].base) +
                         (segs[s].num_blocks - 1) * segs[s].block_stride + segs[s].block_bytes - 1;
      check_on_device(last, s, "last byte");
      for (std::uint64_t v :
           {static_cast<std::uint64_t>(reinterpret_cast<std::uintptr_t>(segs[s].base)),
            static_cast<std::uint64_t>(segs[s].block_stride),
            static_cast<std::uint64_t>(segs[s].block_bytes),
            static_cast<std::uint64_t>(layout.page_offset(s))}) {
        while (align > 1 && v % align != 0) align /= 2;
      }
    }
    vec_ = align >= 16 ? 16 : align >= 4 ? 4 : 1;
    path_ = choose_path(layout, opt_);
    layout_ = &layout;
    // CUDA loads a kernel's module at its first launch (lazy loading), and that load waits for
    // kernels already running: the engine's first store would stall behind its own forward pass
    // (measured on an H200: 101 ms behind a 100 ms kernel). Loading them here, at start-up,
    // keeps that off the serving path.
    SegmentTable::load_kernels();
    store_lanes_.clear();  // before the plan and the table they use
    sums_.reset();
    sub_tables_.clear();
    load_lanes_.clear();
    staging_refused_ = false;
    plan_.reset();
    table_ = std::make_unique<SegmentTable>(segment_rows(layout), vec_, opt_.threads);
    if (DeviceSums::can_sum(layout)) {
      sums_ = std::make_unique<DeviceSums>(table_->rows(), table_->count(), layout);
    }
    if (path_ == CopyPath::kStaged) {
      plan_ = std::make_unique<StagingPlan>(layout, opt_.staging_bytes / StagingLane::kWindows,
                                            *table_);
    }
  }

  void copy_pages(Direction dir, const PageLayout& layout, std::span<const PageMove> moves,
                  StreamHandle stream) override {
    if (table_ == nullptr) throw Error("CUDA copier used before bind()");
    DeviceGuard g(device_);
    auto s = static_cast<cudaStream_t>(stream);
    if (dir == Direction::kToHost) {
      // The pages' checksums, where asked, on the device beside the copy (device_sums.hpp).
      cudaEvent_t summed = sums_ != nullptr ? sums_->fork(moves, s) : nullptr;
      try {
        copy_whole_pages(dir, moves, s);
      } catch (...) {
        if (summed != nullptr) sums_->join(summed, s);
        throw;
      }
      if (summed != nullptr) sums_->join(summed, s);
      return;
    }
    load(
        moves.size() * layout.page_bytes(), s,
        [&] { copy_whole_pages(Direction::kToDevice, moves, s); },
        [&] { table_->launch(Direction::kToDevice, moves, express_blocks_, s); });
    // A load's sums, where asked, of the bytes as they landed, after its copy on its stream.
    if (sums_ != nullptr) sums_->after(moves, s);
  }

  // One layer's segments of each page (layer-wise loads): chunks of kLayerDmaMinChunk and more
  // go to the DMA engines piece by piece, smaller ones through the kernel with a table of these
  // segments alone (the staging windows hold whole pages, so staging is not used).
  void copy_segments(Direction dir, const PageLayout& layout, std::span<const PageMove> moves,
                     std::size_t first, std::size_t last, StreamHandle stream) override {
    if (table_ == nullptr) throw Error("CUDA copier used before bind()");
    const auto& segs = layout.segments();
    if (first == 0 && last == segs.size()) return copy_pages(dir, layout, moves, stream);
    if (first >= last || last > segs.size()) {
      throw Error("copy_segments: no segments [" + std::to_string(first) + ", " +
                  std::to_string(last) + ") in a layout of " + std::to_string(segs.size()));
    }
    DeviceGuard g(device_);
    auto s = static_cast<cudaStream_t>(stream);
    if (dir == Direction::kToHost) return copy_segment_range(dir, moves, first, last, s);
    load(
        moves.size() * layout.range_bytes(first, last), s,
        [&] { copy_segment_range(Direction::kToDevice, moves, first, last, s); },
        [&] { sub_table(first, last).launch(Direction::kToDevice, moves, express_blocks_, s); });
  }

  // A load of `bytes`, timed: `copy` on the layout's path, or `express` (the kernel) when other
  // streams' loads still queued on the DMA engines hold more bytes than it (DmaBacklog).
  template <class Copy, class Express>
  void load(std::size_t bytes, cudaStream_t s, Copy copy, Express express) {
    const auto mark = timer_.begin(s);
    if (backlog_.passes(bytes, s)) {
      express();
    } else {
      copy();
      backlog_.add(s, bytes);
    }
    timer_.end(mark, s, bytes);
  }

  double load_bytes_per_s() const override { return timer_.bytes_per_s(); }

  void copy_bytes(Direction dir, const DeviceBuffer& buf, std::byte* host,
                  StreamHandle stream) override {
    DeviceGuard g(device_);
    auto s = static_cast<cudaStream_t>(stream);
    if (dir == Direction::kToHost) {
      HICACHE_CUDA_CHECK(cudaMemcpyAsync(host, buf.data, buf.bytes, cudaMemcpyDefault, s));
    } else {
      HICACHE_CUDA_CHECK(cudaMemcpyAsync(buf.data, host, buf.bytes, cudaMemcpyDefault, s));
    }
  }

  std::unique_ptr<Fence> record(StreamHandle stream) override {
    DeviceGuard g(device_);
    cudaEvent_t e = events_->take();
    const cudaError_t err = cudaEventRecord(e, static_cast<cudaStream_t>(stream));
    if (err != cudaSuccess) {
      events_->give(e);
      throw_cuda_error(err, "cudaEventRecord", __FILE__, __LINE__);
    }
    return std::make_unique<EventFence>(events_, e);
  }

  std::shared_ptr<HostAllocator> host_allocator() override { return allocator_; }

  const char* path() const override {
    switch (path_) {
      case CopyPath::kDma:
        return "dma";
      case CopyPath::kStaged:
        return "staged";
      default:
        return "kernel";
    }
  }

  bool sums_on_device(const PageLayout& layout) const override {
    return sums_ != nullptr && &layout == layout_;
  }

  // copy_pages_dma joins a run's pieces (dma_pieces.hpp) where a page is one piece.
  bool joins_runs(const PageLayout& layout) const override {
    return &layout == layout_ && path_ == CopyPath::kDma && layout.segments().size() == 1;
  }

  bool supports(Device d) const override {
    return d.kind == DeviceKind::kCuda && d.index == device_;
  }

 private:
  // Each (direction, stream) gets its own lane, up to kMaxLanes a direction; later streams share
  // them. A shared lane couples its streams: a load queued behind long work on one stream holds
  // the lane's windows, and the next load on another stream waits for them.
  static constexpr std::size_t kMaxLanes = 4;
  // nullptr when no staging could be allocated: the kernel copies across PCIe instead (slower,
  // but the engine's device memory is not ours to fight for).
  StagingLane* lane(Direction dir, cudaStream_t s) {
    std::lock_guard<std::mutex> g(lanes_mu_);
    auto& lanes = dir == Direction::kToHost ? store_lanes_ : load_lanes_;
    for (auto& [stream, l] : lanes) {
      if (stream == s) return l.get();
    }
    if (lanes.size() < kMaxLanes && !staging_refused_) {
      try {
        lanes.emplace_back(s, std::make_unique<StagingLane>(*plan_));
        return lanes.back().second.get();
      } catch (const Error&) {
        cudaGetLastError();  // clear the allocation failure
        staging_refused_ = true;
      }
    }
    if (lanes.empty()) return nullptr;
    return lanes[std::hash<cudaStream_t>{}(s) % lanes.size()].second.get();
  }

  // Every chunk a DMA piece, no SM used. Submitted in batches of kDmaBatch pieces as the list is
  // built, so the engines start on the first pieces while the driver takes the rest: one batch
  // of a whole call (7,259 pieces for 1 GiB of MLA pages) held every copy back until the driver
  // had taken all of it.
  void copy_pages_dma(Direction dir, std::span<const PageMove> moves, cudaStream_t s,
                      std::size_t first, std::size_t last) {
    const auto& segs = layout_->segments();
    DmaPieces pieces(kDmaBatch);
    auto submit = [&] {
      copy_batch(pieces.dst(), pieces.src(), pieces.sizes(), pieces.size(), s);
      pieces.clear();
    };
    // One segment: consecutive pages' pieces may continue each other (dma_pieces.hpp). Several:
    // a host page holds its segments one after another, so one segment's pieces of two pages
    // never touch.
    const bool one_segment = last - first == 1;
    for (const PageMove& m : moves) {
      for (std::size_t i = first; i < last; ++i) {
        void* dev = layout_->block_address(i, m.block);
        void* host = m.host + layout_->page_offset(i);
        const auto bytes = static_cast<std::size_t>(segs[i].block_bytes);
        void* to = dir == Direction::kToHost ? host : dev;
        void* from = dir == Direction::kToHost ? dev : host;
        if (!pieces.add(to, from, bytes, one_segment)) {  // a full batch
          submit();
          pieces.add(to, from, bytes, false);
        }
      }
    }
    submit();
  }

  // The batched DMA API refuses the legacy default stream (stream 0: torch's current stream
  // unless the engine set one). The kernel that served it instead loads page-major 1 MiB pages
  // at 0.61 of one contiguous copy on an H100, where the DMA engines reach 0.98: so the pieces go
  // on a stream of the copier's own, after an event of the caller's stream, and the caller's
  // stream then waits for an event after them, which keeps its order (a GPU cache's hit of
  // 64 x 1 MiB on stream 0: 2.05 ms, 1.28 on a stream of the engine's own, docs/performance.md).
  static bool is_legacy(cudaStream_t s) { return s == nullptr || s == cudaStreamLegacy; }
  void copy_pages_dma_any(Direction dir, std::span<const PageMove> moves, cudaStream_t s,
                          std::size_t first, std::size_t last) {
    if (!is_legacy(s)) return copy_pages_dma(dir, moves, s, first, last);
    const cudaStream_t ours = detour_stream();
    events_->order(s, ours);
    try {
      copy_pages_dma(dir, moves, ours, first, last);
    } catch (...) {
      // What was submitted must still be covered by the caller's later fences.
      if (!order_noexcept(ours, s)) cudaStreamSynchronize(ours);
      throw;
    }
    // If the caller's stream cannot be made to wait, the copy is waited for here: once it is
    // done, whatever the caller enqueues next comes after it all the same.
    if (!order_noexcept(ours, s)) cudaStreamSynchronize(ours);
  }
  cudaStream_t detour_stream() {
    std::lock_guard<std::mutex> g(detour_mu_);
    if (detour_ == nullptr) {
      HICACHE_CUDA_CHECK(cudaStreamCreateWithFlags(&detour_, cudaStreamNonBlocking));
    }
    return detour_;
  }
  bool order_noexcept(cudaStream_t from, cudaStream_t to) noexcept {
    try {
      events_->order(from, to);
      return true;
    } catch (...) {
      cudaGetLastError();
      return false;
    }
  }

  void copy_whole_pages(Direction dir, std::span<const PageMove> moves, cudaStream_t s) {
    if (path_ == CopyPath::kDma) {
      return copy_pages_dma_any(dir, moves, s, 0, layout_->segments().size());
    }
    if (plan_ != nullptr) {
      if (StagingLane* l = lane(dir, s)) return l->copy(dir, moves, staged_blocks_, s);
    }
    table_->launch(dir, moves, opt_.max_blocks, s);
  }

  void copy_segment_range(Direction dir, std::span<const PageMove> moves, std::size_t first,
                          std::size_t last, cudaStream_t s) {
    const auto& segs = layout_->segments();
    std::int64_t smallest = segs[first].block_bytes;
    for (std::size_t i = first; i < last; ++i) smallest = std::min(smallest, segs[i].block_bytes);
    if (static_cast<std::size_t>(smallest) >= kLayerDmaMinChunk) {
      copy_pages_dma_any(dir, moves, s, first, last);
    } else {
      sub_table(first, last).launch(dir, moves, opt_.max_blocks, s);
    }
  }

  // The kernel's table for segments [first, last), made at first use.
  const SegmentTable& sub_table(std::size_t first, std::size_t last) {
    std::lock_guard<std::mutex> g(sub_tables_mu_);
    auto& t = sub_tables_[{first, last}];
    if (t == nullptr) {
      auto rows = segment_rows(*layout_);
      rows = std::vector<SegmentDesc>(rows.begin() + static_cast<std::ptrdiff_t>(first),
                                      rows.begin() + static_cast<std::ptrdiff_t>(last));
      t = std::make_unique<SegmentTable>(std::move(rows), vec_, opt_.threads);
    }
    return *t;
  }

  void check_on_device(const void* p, std::size_t s, const char* what) const {
    cudaPointerAttributes attr{};
    const cudaError_t err = cudaPointerGetAttributes(&attr, p);
    if (err != cudaSuccess || attr.type != cudaMemoryTypeDevice || attr.device != device_) {
      cudaGetLastError();  // clear a sticky lookup failure
      throw std::invalid_argument("segment " + std::to_string(s) + ": its " + what +
                                  " is not device memory of cuda:" + std::to_string(device_));
    }
  }

  int device_;
  CudaCopierOptions opt_;
  std::shared_ptr<EventPool> events_;
  std::shared_ptr<HostAllocator> allocator_;
  std::unique_ptr<SegmentTable> table_;  // whole pages: the kernel across PCIe, and staging
  std::unique_ptr<DeviceSums> sums_;     // page checksums on the device; reads table_
  std::mutex detour_mu_;
  cudaStream_t detour_ = nullptr;      // DMA pieces of calls on the legacy stream (is_legacy)
  std::unique_ptr<StagingPlan> plan_;  // staged path only
  std::mutex sub_tables_mu_;
  std::map<std::pair<std::size_t, std::size_t>, std::unique_ptr<SegmentTable>> sub_tables_;
  mutable LoadTimer timer_;
  DmaBacklog backlog_;
  int express_blocks_ = 16;  // CTAs of a load that passes a backlog (DmaBacklog)
  std::mutex lanes_mu_;
  bool staging_refused_ = false;  // a staging allocation failed: no further attempts
  std::vector<std::pair<cudaStream_t, std::unique_ptr<StagingLane>>> store_lanes_, load_lanes_;
  int vec_ = 16;
  int staged_blocks_ = 4;  // CTAs of the staged path's gathers/scatters (HBM to HBM)
  CopyPath path_ = CopyPath::kKernel;
  const PageLayout* layout_ = nullptr;
};

}  // namespace
}  // namespace cuda

bool cuda_available() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return n > 0;
}

std::shared_ptr<HostAllocator> make_cuda_registered_allocator(
    std::shared_ptr<HostAllocator> inner) {
  return cuda::make_registered_view(std::move(inner));
}

std::shared_ptr<Copier> make_cuda_copier(int device, CudaCopierOptions options) {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || device < 0 || device >= n) {
    cudaGetLastError();
    throw std::invalid_argument("CUDA device " + std::to_string(device) + " does not exist (" +
                                std::to_string(n) + " visible)");
  }
  options.validate();
  return std::make_shared<cuda::CudaCopier>(device, options);
}

}  // namespace hicache
