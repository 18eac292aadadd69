#pragma once
// Fixed-size host slots, allocated lazily in chunks.
//
// A pool of N slots never allocates N * slot_bytes up front: the chunk holding a slot is
// allocated the first time that slot is used, so an idle cache costs nothing and a huge pool is
// neither one giant allocation nor minutes of pinning at start-up. Slots are rounded up to 256
// bytes (alignment for vector copies), never to a power of two.

#include <cstddef>
#include <cstdint>
#include <memory>
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
};

/// Page-aligned memory from the C++ runtime.
std::shared_ptr<HostAllocator> make_aligned_host_allocator();

class HostPool {
 public:
  static constexpr std::size_t kSlotAlign = 256;

  /// @param chunk_bytes target size of one allocation; a chunk holds at least one slot.
  /// @throws std::invalid_argument for zero sizes.
  HostPool(std::size_t slot_bytes, std::int64_t num_slots, std::size_t chunk_bytes,
           std::shared_ptr<HostAllocator> allocator);
  ~HostPool();
  HostPool(const HostPool&) = delete;
  HostPool& operator=(const HostPool&) = delete;

  /// Address of slot i, allocating its chunk on first use.
  /// @throws std::out_of_range for i outside [0, num_slots); hicache::Error if allocation fails.
  std::byte* slot(std::int64_t i);

  std::size_t slot_bytes() const { return slot_bytes_; }
  std::size_t slot_stride() const { return slot_stride_; }
  std::int64_t num_slots() const { return num_slots_; }
  std::size_t allocated_bytes() const { return allocated_bytes_; }
  const HostAllocator& allocator() const { return *allocator_; }

 private:
  std::size_t slot_bytes_;
  std::size_t slot_stride_;
  std::int64_t num_slots_;
  std::int64_t slots_per_chunk_;
  std::shared_ptr<HostAllocator> allocator_;
  std::vector<std::byte*> chunks_;
  std::size_t allocated_bytes_ = 0;
};

}  // namespace hicache
