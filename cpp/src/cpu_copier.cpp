#include "hicache/cpu_copier.hpp"

#include <cstring>
#include <deque>
#include <map>

namespace hicache {
namespace {

void copy_pages_now(Direction dir, const PageLayout& layout, std::span<const PageMove> moves) {
  const auto& segs = layout.segments();
  for (const PageMove& m : moves) {
    for (std::size_t s = 0; s < segs.size(); ++s) {
      std::byte* block = layout.block_address(s, m.block);
      std::byte* host = m.host + layout.page_offset(s);
      const auto n = static_cast<std::size_t>(segs[s].block_bytes);
      if (dir == Direction::kToHost) {
        std::memcpy(host, block, n);
      } else {
        std::memcpy(block, host, n);
      }
    }
  }
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

void CpuCopier::copy_pages(Direction dir, const PageLayout& layout, std::span<const PageMove> moves,
                           StreamHandle) {
  copy_pages_now(dir, layout, moves);
}

void CpuCopier::copy_bytes(Direction dir, const DeviceBuffer& buf, std::byte* host, StreamHandle) {
  copy_bytes_now(dir, buf, host);
}

std::unique_ptr<Fence> CpuCopier::record(StreamHandle) { return std::make_unique<DoneFence>(); }

// --- DeferredCopier ---------------------------------------------------------------------------

struct DeferredCopier::State {
  struct Stream {
    std::deque<std::function<void()>> queue;
    std::uint64_t recorded = 0;   // fences handed out on this stream
    std::uint64_t completed = 0;  // fences with serial <= completed are done

    std::size_t run_all() {
      const std::size_t n = queue.size();
      while (!queue.empty()) {
        queue.front()();
        queue.pop_front();
      }
      completed = recorded;
      return n;
    }
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
    if (serial_ > s.completed) s.run_all();
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
  std::vector<PageMove> copy(moves.begin(), moves.end());
  // The layout outlives the cache's transfers, which all complete before the cache is destroyed.
  const PageLayout* l = &layout;
  std::lock_guard<std::mutex> g(state_->mu);
  state_->streams[stream].queue.emplace_back(
      [dir, l, copy = std::move(copy)] { copy_pages_now(dir, *l, copy); });
}

void DeferredCopier::copy_bytes(Direction dir, const DeviceBuffer& buf, std::byte* host,
                                StreamHandle stream) {
  std::lock_guard<std::mutex> g(state_->mu);
  state_->streams[stream].queue.emplace_back([dir, buf, host] { copy_bytes_now(dir, buf, host); });
}

std::unique_ptr<Fence> DeferredCopier::record(StreamHandle stream) {
  std::lock_guard<std::mutex> g(state_->mu);
  return std::make_unique<DeferredFence>(state_, stream, ++state_->streams[stream].recorded);
}

std::size_t DeferredCopier::complete(StreamHandle stream) {
  std::lock_guard<std::mutex> g(state_->mu);
  return state_->streams[stream].run_all();
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
  for (const auto& [handle, s] : state_->streams) n += s.queue.size();
  return n;
}

}  // namespace hicache
