#pragma once
// Fixed-size host slots, allocated in chunks as they are needed.
//
// A pool of N slots never allocates N * slot_bytes up front: an idle cache costs (almost)
// nothing, and a huge pool is neither one giant allocation nor minutes of pinning at start-up.
// Slots are rounded up to 256 bytes (alignment for vector copies), never to a power of two.
//
// Growth modes:
//  - kOnDemand: the chunk holding a slot is allocated by the first slot() call in it.
//  - kUpFront: every chunk is allocated by the constructor. For pinned memory this is the
//    default: pinning waits for the GPU to drain and, while it runs, other CUDA calls of the
//    process wait too (measured on an H200: a store issued while another thread pinned a chunk
//    took 101 ms, the length of the work queued on the GPU), so serving should never pin.
//  - kAhead: for allocators whose allocation waits for the GPU (pinning with cudaHostRegister or
//    cudaHostAlloc synchronizes the device, so the engine's thread would stall behind its own
//    queued work). The first chunk is allocated by the constructor; each next chunk is allocated
//    on a background thread as soon as the one before it is first used. slot() never blocks: it
//    returns nullptr while its chunk is still being allocated, and the cache skips that store.

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
  /// Whether allocate() waits for the device (then pools grow ahead, off the caller's thread).
  virtual bool waits_for_device() const { return false; }
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
