#pragma once
// Copiers for engine memory that the CPU can address: the real one for CPU engines, and a
// deferred one that models an asynchronous device for tests.

#include <functional>
#include <memory>
#include <mutex>
#include <vector>

#include "hicache/copier.hpp"
#include "hicache/copy_rate.hpp"

namespace hicache {

/// Copies at once, on several threads for calls of many bytes and with non-temporal stores for
/// calls of 4 MiB and more (they would not stay in the caches). Ignores the stream.
class CpuCopier : public Copier {
 public:
  explicit CpuCopier(std::shared_ptr<HostAllocator> allocator = make_aligned_host_allocator());
  void copy_pages(Direction dir, const PageLayout& layout, std::span<const PageMove> moves,
                  StreamHandle stream) override;
  void copy_segments(Direction dir, const PageLayout& layout, std::span<const PageMove> moves,
                     std::size_t first, std::size_t last, StreamHandle stream) override;
  void copy_bytes(Direction dir, const DeviceBuffer& engine_buffer, std::byte* host,
                  StreamHandle stream) override;
  std::unique_ptr<Fence> record(StreamHandle stream) override;
  std::shared_ptr<HostAllocator> host_allocator() override { return allocator_; }
  bool supports(Device device) const override { return device.kind == DeviceKind::kCpu; }
  bool sums_pages(const PageLayout& layout) const override;
  const char* path() const override { return "cpu"; }
  double load_bytes_per_s() const override { return load_rate_.bytes_per_s(); }

 private:
  std::shared_ptr<HostAllocator> allocator_;
  CopyRate load_rate_;
};

/// Moves nothing and allocates nothing: every transfer completes at once and host slots are
/// fake addresses never dereferenced. For replaying traces through the real index and policy.
class NullCopier : public Copier {
 public:
  NullCopier();
  void copy_pages(Direction, const PageLayout&, std::span<const PageMove>, StreamHandle) override {}
  void copy_segments(Direction, const PageLayout&, std::span<const PageMove>, std::size_t,
                     std::size_t, StreamHandle) override {}
  void copy_bytes(Direction, const DeviceBuffer&, std::byte*, StreamHandle) override {}
  std::unique_ptr<Fence> record(StreamHandle stream) override;
  std::shared_ptr<HostAllocator> host_allocator() override { return allocator_; }
  bool supports(Device) const override { return true; }
  const char* path() const override { return "null"; }

 private:
  std::shared_ptr<HostAllocator> allocator_;
};

/// Test copier modelling an asynchronous device on the CPU: each stream is a queue; copies only
/// happen, and fences only complete, when complete() is called for their stream (or a fence is
/// waited on, as the cache does on teardown). A slot reused while its transfer is pending would
/// therefore receive or supply the wrong bytes, which tests can see; streams complete out of
/// order with each other, as on a GPU.
class DeferredCopier : public Copier {
 public:
  DeferredCopier();
  void copy_pages(Direction dir, const PageLayout& layout, std::span<const PageMove> moves,
                  StreamHandle stream) override;
  void copy_segments(Direction dir, const PageLayout& layout, std::span<const PageMove> moves,
                     std::size_t first, std::size_t last, StreamHandle stream) override;
  void copy_bytes(Direction dir, const DeviceBuffer& engine_buffer, std::byte* host,
                  StreamHandle stream) override;
  std::unique_ptr<Fence> record(StreamHandle stream) override;
  std::shared_ptr<HostAllocator> host_allocator() override { return allocator_; }
  bool supports(Device device) const override { return device.kind == DeviceKind::kCpu; }
  const char* path() const override { return "deferred"; }

  /// Performs every queued copy of `stream`, in order, and completes its fences.
  /// Returns the number of copies performed.
  std::size_t complete(StreamHandle stream);
  /// Performs the next `copies` queued copies of `stream` and completes the fences recorded
  /// before the copy after them (a stream part done: one layer of a layer-wise load).
  std::size_t complete_next(StreamHandle stream, std::size_t copies = 1);
  /// The same for every stream.
  std::size_t complete();
  /// Copies queued and not yet performed, over all streams.
  std::size_t pending() const;

  struct State;  // shared with the fences it hands out

 private:
  std::shared_ptr<HostAllocator> allocator_;
  std::shared_ptr<State> state_;
};

}  // namespace hicache
