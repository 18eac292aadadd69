#include "hicache/host_pool.hpp"

#include <algorithm>
#include <cstdlib>
#include <new>
#include <stdexcept>
#include <string>

#include "hicache/error.hpp"

namespace hicache {
namespace {

class AlignedHostAllocator final : public HostAllocator {
 public:
  void* allocate(std::size_t bytes) override {
    constexpr std::size_t kPage = 4096;
    void* p = std::aligned_alloc(kPage, (bytes + kPage - 1) / kPage * kPage);
    if (p == nullptr) throw Error("host allocation of " + std::to_string(bytes) + " bytes failed");
    return p;
  }
  void deallocate(void* p, std::size_t) noexcept override { std::free(p); }
  const char* name() const override { return "aligned"; }
};

}  // namespace

std::shared_ptr<HostAllocator> make_aligned_host_allocator() {
  return std::make_shared<AlignedHostAllocator>();
}

HostPool::HostPool(std::size_t slot_bytes, std::int64_t num_slots, std::size_t chunk_bytes,
                   std::shared_ptr<HostAllocator> allocator)
    : slot_bytes_(slot_bytes), num_slots_(num_slots), allocator_(std::move(allocator)) {
  if (slot_bytes == 0) throw std::invalid_argument("host pool: slot_bytes must be positive");
  if (num_slots < 0) throw std::invalid_argument("host pool: num_slots must be >= 0");
  if (!allocator_) throw std::invalid_argument("host pool: allocator required");
  slot_stride_ = (slot_bytes + kSlotAlign - 1) / kSlotAlign * kSlotAlign;
  slots_per_chunk_ =
      std::max<std::int64_t>(1, static_cast<std::int64_t>(chunk_bytes / slot_stride_));
  const std::int64_t num_chunks = (num_slots + slots_per_chunk_ - 1) / slots_per_chunk_;
  chunks_.assign(static_cast<std::size_t>(num_chunks), nullptr);
}

HostPool::~HostPool() {
  for (std::size_t c = 0; c < chunks_.size(); ++c) {
    if (chunks_[c] == nullptr) continue;
    const std::int64_t first = static_cast<std::int64_t>(c) * slots_per_chunk_;
    const std::int64_t n = std::min(slots_per_chunk_, num_slots_ - first);
    allocator_->deallocate(chunks_[c], static_cast<std::size_t>(n) * slot_stride_);
  }
}

std::byte* HostPool::slot(std::int64_t i) {
  if (i < 0 || i >= num_slots_) {
    throw std::out_of_range("host slot " + std::to_string(i) + " is outside [0, " +
                            std::to_string(num_slots_) + ")");
  }
  const auto c = static_cast<std::size_t>(i / slots_per_chunk_);
  if (chunks_[c] == nullptr) {
    const std::int64_t first = static_cast<std::int64_t>(c) * slots_per_chunk_;
    const std::int64_t n = std::min(slots_per_chunk_, num_slots_ - first);
    const std::size_t bytes = static_cast<std::size_t>(n) * slot_stride_;
    chunks_[c] = static_cast<std::byte*>(allocator_->allocate(bytes));
    allocated_bytes_ += bytes;
  }
  return chunks_[c] + static_cast<std::size_t>(i % slots_per_chunk_) * slot_stride_;
}

}  // namespace hicache
