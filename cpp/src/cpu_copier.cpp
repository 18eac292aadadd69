#include "hicache/cpu_copier.hpp"

#include <chrono>
#include <cstdint>
#include <cstring>
#include <deque>
#include <map>

#include "page_checksum.hpp"
#include "page_threads.hpp"
#include "stream_copy.hpp"

namespace hicache {
namespace {

// Whether a page of `layout` can be summed segment by segment as it is copied: the checksum
// takes a page in pieces of whole blocks, but the last.
bool summable(const PageLayout& layout) {
  const auto& segs = layout.segments();
  for (std::size_t s = 0; s + 1 < segs.size(); ++s) {
    if (segs[s].block_bytes % detail::ChecksumCopy::kBlock != 0) return false;
  }
  return true;
}

void copy_through_caches(std::byte* dst, const std::byte* src, std::size_t n) {
  std::memcpy(dst, src, n);
}

// Segments [first, last) of each page.
void copy_pages_now(Direction dir, const PageLayout& layout, std::span<const PageMove> moves,
                    std::size_t first, std::size_t last) {
  const auto& segs = layout.segments();
  const bool sums = first == 0 && last == segs.size() && summable(layout);
  // A call larger than the caches writes around them (stream_copy.hpp).
  const bool streaming =
      moves.size() * layout.range_bytes(first, last) >= detail::kStreamingCallBytes;
  void (*const copy)(std::byte*, const std::byte*, std::size_t) =
      streaming ? detail::copy_streaming : copy_through_caches;
  // Pages on several threads when there are many bytes (a tier's round loaded into CPU blocks
  // ran at one core's memcpy rate, 14 ms for 64 MiB on an H200 host).
  detail::for_each_page(moves.size(), layout.range_bytes(first, last), [&](std::size_t i) {
    const PageMove& m = moves[i];
    // Asked for the page's checksum: copied and summed in one pass (no slower than memcpy:
    // 64 MiB in 2.5 ms against 2.9 on one core of the 2-core CI machine).
    if (m.checksum != nullptr && sums) {
      detail::ChecksumCopy sum;
      for (std::size_t s = 0; s < last; ++s) {
        const auto n = static_cast<std::size_t>(segs[s].block_bytes);
        std::byte* block = layout.block_address(s, m.block);
        std::byte* host = m.host + layout.page_offset(s);
        if (dir == Direction::kToHost) {
          sum.add({block, n}, host);
        } else {
          sum.add({host, n}, block);
        }
      }
      *m.checksum = sum.value();
      return;
    }
    for (std::size_t s = first; s < last; ++s) {
      std::byte* block = layout.block_address(s, m.block);
      std::byte* host = m.host + layout.page_offset(s);
      const auto n = static_cast<std::size_t>(segs[s].block_bytes);
      if (dir == Direction::kToHost) {
        copy(host, block, n);
      } else {
        copy(block, host, n);
      }
    }
  });
}

void copy_bytes_now(Direction dir, const DeviceBuffer& buf, std::byte* host) {
  if (dir == Direction::kToHost) {
    std::memcpy(host, buf.data, buf.bytes);
  } else {
    std::memcpy(buf.data, host, buf.bytes);
  }
}

class DoneFence final : public Fence {
 public:
  bool done() override { return true; }
  void wait() noexcept override {}
};

// Hands out addresses no copy will ever touch.
class NoMemory final : public HostAllocator {
 public:
  void* allocate(std::size_t) override { return reinterpret_cast<void*>(std::uintptr_t{1} << 44); }
  void deallocate(void*, std::size_t) noexcept override {}
  const char* name() const override { return "none"; }
};

}  // namespace

NullCopier::NullCopier() : allocator_(std::make_shared<NoMemory>()) {}

std::unique_ptr<Fence> NullCopier::record(StreamHandle) { return std::make_unique<DoneFence>(); }

CpuCopier::CpuCopier(std::shared_ptr<HostAllocator> allocator) : allocator_(std::move(allocator)) {}

bool CpuCopier::sums_pages(const PageLayout& layout) const { return summable(layout); }

void CpuCopier::copy_pages(Direction dir, const PageLayout& layout, std::span<const PageMove> moves,
                           StreamHandle stream) {
  copy_segments(dir, layout, moves, 0, layout.segments().size(), stream);
}

void CpuCopier::copy_segments(Direction dir, const PageLayout& layout,
                              std::span<const PageMove> moves, std::size_t first, std::size_t last,
                              StreamHandle) {
  const auto t0 = std::chrono::steady_clock::now();
  copy_pages_now(dir, layout, moves, first, last);
  if (dir == Direction::kToDevice && !moves.empty()) {
    const std::size_t bytes = moves.size() * layout.range_bytes(first, last);
    load_rate_.add(bytes,
                   std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
}

void CpuCopier::copy_bytes(Direction dir, const DeviceBuffer& buf, std::byte* host, StreamHandle) {
  copy_bytes_now(dir, buf, host);
}

std::unique_ptr<Fence> CpuCopier::record(StreamHandle) { return std::make_unique<DoneFence>(); }

// --- DeferredCopier ---------------------------------------------------------------------------

struct DeferredCopier::State {
  struct Stream {
    // Copies, and the fences recorded between them (serial > 0): a fence completes when the
    // copies before it ran, so a stream can run part of its work (complete_next).
    struct Item {
      std::function<void()> copy;
      std::uint64_t fence = 0;
    };
    std::deque<Item> queue;
    std::uint64_t recorded = 0;   // fences handed out on this stream
    std::uint64_t completed = 0;  // fences with serial <= completed are done
    std::size_t copies = 0;       // copies in the queue

    // Runs up to `limit` copies and the fences that follow them. @return copies run.
    std::size_t run(std::size_t limit) {
      std::size_t n = 0;
      while (!queue.empty()) {
        Item& item = queue.front();
        if (item.fence == 0) {
          if (n == limit) break;
          item.copy();
          ++n;
          --copies;
        } else {
          completed = item.fence;
        }
        queue.pop_front();
      }
      return n;
    }
    std::size_t run_all() { return run(SIZE_MAX); }
  };
  mutable std::mutex mu;
  std::map<StreamHandle, Stream> streams;
};

namespace {

class DeferredFence final : public Fence {
 public:
  DeferredFence(std::shared_ptr<DeferredCopier::State> st, StreamHandle stream,
                std::uint64_t serial)
      : st_(std::move(st)), stream_(stream), serial_(serial) {}
  bool done() override {
    std::lock_guard<std::mutex> g(st_->mu);
    return serial_ <= st_->streams[stream_].completed;
  }
  void wait() noexcept override {
    std::lock_guard<std::mutex> g(st_->mu);
    auto& s = st_->streams[stream_];
    while (serial_ > s.completed && !s.queue.empty()) s.run(1);  // up to this fence only
  }

 private:
  std::shared_ptr<DeferredCopier::State> st_;
  StreamHandle stream_;
  std::uint64_t serial_;
};

}  // namespace

DeferredCopier::DeferredCopier()
    : allocator_(make_aligned_host_allocator()), state_(std::make_shared<State>()) {}

void DeferredCopier::copy_pages(Direction dir, const PageLayout& layout,
                                std::span<const PageMove> moves, StreamHandle stream) {
  copy_segments(dir, layout, moves, 0, layout.segments().size(), stream);
}

void DeferredCopier::copy_segments(Direction dir, const PageLayout& layout,
                                   std::span<const PageMove> moves, std::size_t first,
                                   std::size_t last, StreamHandle stream) {
  std::vector<PageMove> copy(moves.begin(), moves.end());
  // It does not sum pages (sums_pages is false): a checksum pointer may not outlive the call.
  for (PageMove& m : copy) m.checksum = nullptr;
  // The layout outlives the cache's transfers, which all complete before the cache is destroyed.
  const PageLayout* l = &layout;
  std::lock_guard<std::mutex> g(state_->mu);
  auto& st = state_->streams[stream];
  st.queue.push_back({[dir, l, first, last, copy = std::move(copy)] {
                        copy_pages_now(dir, *l, copy, first, last);
                      },
                      0});
  ++st.copies;
}

void DeferredCopier::copy_bytes(Direction dir, const DeviceBuffer& buf, std::byte* host,
                                StreamHandle stream) {
  std::lock_guard<std::mutex> g(state_->mu);
  auto& st = state_->streams[stream];
  st.queue.push_back({[dir, buf, host] { copy_bytes_now(dir, buf, host); }, 0});
  ++st.copies;
}

std::unique_ptr<Fence> DeferredCopier::record(StreamHandle stream) {
  std::lock_guard<std::mutex> g(state_->mu);
  auto& st = state_->streams[stream];
  st.queue.push_back({{}, ++st.recorded});
  return std::make_unique<DeferredFence>(state_, stream, st.recorded);
}

std::size_t DeferredCopier::complete(StreamHandle stream) {
  std::lock_guard<std::mutex> g(state_->mu);
  return state_->streams[stream].run_all();
}

std::size_t DeferredCopier::complete_next(StreamHandle stream, std::size_t copies) {
  std::lock_guard<std::mutex> g(state_->mu);
  return state_->streams[stream].run(copies);
}

std::size_t DeferredCopier::complete() {
  std::lock_guard<std::mutex> g(state_->mu);
  std::size_t n = 0;
  for (auto& [handle, s] : state_->streams) n += s.run_all();
  return n;
}

std::size_t DeferredCopier::pending() const {
  std::lock_guard<std::mutex> g(state_->mu);
  std::size_t n = 0;
  for (const auto& [handle, s] : state_->streams) n += s.copies;
  return n;
}

}  // namespace hicache
