#pragma once
// Fixed-size host slots, allocated in chunks as they are needed.
//
// A pool of N slots never allocates N * slot_bytes up front: an idle cache costs (almost)
// nothing, and a huge pool is neither one giant allocation nor minutes of pinning at start-up.
// Slots are rounded up to 256 bytes (alignment for vector copies), never to a power of two.
//
// Growth modes:
//  - kOnDemand: the chunk holding a slot is allocated by the first slot() call in it (CPU pools).
//  - kAhead: for slow allocators (pinning runs at about 13 GB/s, so a 1 GiB chunk takes ~80 ms
//    that the engine's thread should not pay). The first chunk is allocated by the constructor;
//    each next chunk on a background thread as soon as the one before it is first used. slot()
//    never blocks: it returns nullptr while its chunk is still being allocated, and the cache
//    skips that store. Pinning does not wait for the GPU (measured on an H200: 48 ms for 256 MiB
//    while a 100 ms kernel ran, 51 ms idle), so the background thread does not stall serving.
//  - kUpFront: every chunk is allocated by the constructor (predictable, nothing left to pin).

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace hicache {

/// Source of host memory for a pool: plain page-aligned memory for the CPU copier, pinned and
/// mapped memory for the CUDA copier.
class HostAllocator {
 public:
  virtual ~HostAllocator() = default;
  /// @throws hicache::Error if the memory cannot be had.
  virtual void* allocate(std::size_t bytes) = 0;
  virtual void deallocate(void* p, std::size_t bytes) noexcept = 0;
  virtual const char* name() const = 0;
  /// Whether allocate() is slow enough to keep off the engine's thread (pinning: about 50 ms per
  /// 256 MiB on an H200 host); such pools grow ahead of use on a background thread.
  virtual bool allocation_is_slow() const { return false; }
};

/// Page-aligned memory from the C++ runtime.
std::shared_ptr<HostAllocator> make_aligned_host_allocator();

class HostPool {
 public:
  static constexpr std::size_t kSlotAlign = 256;
  enum class Growth { kOnDemand, kAhead, kUpFront };

  /// @param chunk_bytes target size of one allocation; a chunk holds at least one slot.
  /// @throws std::invalid_argument for zero sizes; hicache::Error if kAhead cannot allocate the
  ///         first chunk.
  HostPool(std::size_t slot_bytes, std::int64_t num_slots, std::size_t chunk_bytes,
           std::shared_ptr<HostAllocator> allocator, Growth growth = Growth::kOnDemand);
  ~HostPool();
  HostPool(const HostPool&) = delete;
  HostPool& operator=(const HostPool&) = delete;

  /// Address of slot i. kOnDemand: allocates its chunk on first use. kAhead: nullptr while the
  /// chunk is being allocated in the background.
  /// @throws std::out_of_range for i outside [0, num_slots); hicache::Error if allocation failed
  ///         (kAhead: the failure of the background attempt, which a later call retries).
  std::byte* slot(std::int64_t i);

  /// Blocks until every chunk requested so far is allocated or failed (tests, benchmarks).
  void wait_idle();

  std::size_t slot_bytes() const { return slot_bytes_; }
  std::size_t slot_stride() const { return slot_stride_; }
  std::int64_t num_slots() const { return num_slots_; }
  std::size_t allocated_bytes() const;
  const HostAllocator& allocator() const { return *allocator_; }

 private:
  enum class State { kNone, kRequested, kReady, kFailed };
  std::size_t chunk_size(std::size_t c) const;
  void allocate_now(std::size_t c);  // caller holds mu_ (released while allocating in kAhead)
  void request(std::size_t c);       // caller holds mu_
  void worker();

  std::size_t slot_bytes_;
  std::size_t slot_stride_;
  std::int64_t num_slots_;
  std::int64_t slots_per_chunk_;
  std::shared_ptr<HostAllocator> allocator_;
  Growth growth_;

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::byte*> chunks_;
  std::vector<State> state_;
  std::vector<std::string> failure_;
  std::size_t allocated_bytes_ = 0;
  std::vector<std::size_t> queue_;
  bool stopping_ = false;
  bool busy_ = false;
  std::thread thread_;
};

}  // namespace hicache
