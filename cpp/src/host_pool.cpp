#include "hicache/host_pool.hpp"

#include <algorithm>
#include <cstdlib>
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
                   std::shared_ptr<HostAllocator> allocator, Growth growth)
    : slot_bytes_(slot_bytes),
      num_slots_(num_slots),
      allocator_(std::move(allocator)),
      growth_(growth) {
  if (slot_bytes == 0) throw std::invalid_argument("host pool: slot_bytes must be positive");
  if (num_slots < 0) throw std::invalid_argument("host pool: num_slots must be >= 0");
  if (!allocator_) throw std::invalid_argument("host pool: allocator required");
  slot_stride_ = (slot_bytes + kSlotAlign - 1) / kSlotAlign * kSlotAlign;
  slots_per_chunk_ =
      std::max<std::int64_t>(1, static_cast<std::int64_t>(chunk_bytes / slot_stride_));
  const auto num_chunks =
      static_cast<std::size_t>((num_slots + slots_per_chunk_ - 1) / slots_per_chunk_);
  chunks_.assign(num_chunks, nullptr);
  state_.assign(num_chunks, State::kNone);
  failure_.assign(num_chunks, std::string());
  if (growth_ != Growth::kOnDemand && num_chunks > 0) {
    // At start-up, where waiting for the device costs nothing.
    std::unique_lock<std::mutex> lock(mu_);
    const std::size_t upfront = growth_ == Growth::kUpFront ? num_chunks : 1;
    for (std::size_t c = 0; c < upfront; ++c) {
      allocate_now(c);
      if (state_[c] == State::kFailed) {
        lock.unlock();
        for (std::size_t d = 0; d < c; ++d) allocator_->deallocate(chunks_[d], chunk_size(d));
        throw Error("pinning the host pool failed at chunk " + std::to_string(c) + " of " +
                    std::to_string(num_chunks) + ": " + failure_[c]);
      }
    }
  }
}

HostPool::~HostPool() {
  {
    std::lock_guard<std::mutex> g(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
  for (std::size_t c = 0; c < chunks_.size(); ++c) {
    if (chunks_[c] != nullptr) allocator_->deallocate(chunks_[c], chunk_size(c));
  }
}

std::size_t HostPool::chunk_size(std::size_t c) const {
  const std::int64_t first = static_cast<std::int64_t>(c) * slots_per_chunk_;
  return static_cast<std::size_t>(std::min(slots_per_chunk_, num_slots_ - first)) * slot_stride_;
}

void HostPool::allocate_now(std::size_t c) {
  const std::size_t bytes = chunk_size(c);
  try {
    auto* p = static_cast<std::byte*>(allocator_->allocate(bytes));
    chunks_[c] = p;
    state_[c] = State::kReady;
    allocated_bytes_ += bytes;
  } catch (const std::exception& e) {
    state_[c] = State::kFailed;
    failure_[c] = e.what();
  }
}

void HostPool::request(std::size_t c) {
  if (c >= state_.size() || state_[c] == State::kReady || state_[c] == State::kRequested) return;
  state_[c] = State::kRequested;
  queue_.push_back(c);
  if (!thread_.joinable()) thread_ = std::thread([this] { worker(); });
  cv_.notify_all();
}

void HostPool::worker() {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
    if (stopping_) return;
    const std::size_t c = queue_.front();
    queue_.erase(queue_.begin());
    busy_ = true;
    const std::size_t bytes = chunk_size(c);
    lock.unlock();  // the allocation may wait for the GPU: never under the lock
    std::byte* p = nullptr;
    std::string err;
    try {
      p = static_cast<std::byte*>(allocator_->allocate(bytes));
    } catch (const std::exception& e) {
      err = e.what();
    }
    lock.lock();
    busy_ = false;
    if (p != nullptr) {
      chunks_[c] = p;
      state_[c] = State::kReady;
      allocated_bytes_ += bytes;
    } else {
      state_[c] = State::kFailed;
      failure_[c] = err;
    }
    cv_.notify_all();
  }
}

std::byte* HostPool::slot(std::int64_t i) {
  if (i < 0 || i >= num_slots_) {
    throw std::out_of_range("host slot " + std::to_string(i) + " is outside [0, " +
                            std::to_string(num_slots_) + ")");
  }
  const auto c = static_cast<std::size_t>(i / slots_per_chunk_);
  std::unique_lock<std::mutex> lock(mu_);
  if (state_[c] != State::kReady) {
    if (growth_ == Growth::kOnDemand) {
      allocate_now(c);
    } else if (state_[c] == State::kNone) {
      request(c);
      return nullptr;
    } else if (state_[c] == State::kRequested) {
      return nullptr;
    }
    if (state_[c] == State::kFailed) {
      state_[c] = State::kNone;  // a later call tries again
      throw Error(failure_[c]);
    }
  }
  if (growth_ == Growth::kAhead) request(c + 1);  // keep one chunk ahead of use
  return chunks_[c] + static_cast<std::size_t>(i % slots_per_chunk_) * slot_stride_;
}

void HostPool::wait_idle() {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [&] { return queue_.empty() && !busy_; });
}

std::size_t HostPool::allocated_bytes() const {
  std::lock_guard<std::mutex> g(mu_);
  return allocated_bytes_;
}

}  // namespace hicache
