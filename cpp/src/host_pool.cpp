#include "hicache/host_pool.hpp"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <stdexcept>
#include <string>

#include "hicache/error.hpp"
#include "hicache/host_memory.hpp"
#include "huge_pages.hpp"

namespace hicache {
namespace {

// Host allocators hand out whole pages (aligned_alloc, mmap, cudaHostAlloc): the largest
// alignment a slot can be given by its stride alone.
constexpr std::size_t kPage = 4096;

// Chunks of a huge page and more are mapped on huge pages (huge_pages.hpp), smaller ones come
// from aligned_alloc.
class AlignedHostAllocator final : public HostAllocator {
 public:
  void* allocate(std::size_t bytes) override {
    if (bytes >= detail::kHugePage) return detail::map_huge_aligned(bytes);
    void* p = std::aligned_alloc(kPage, (bytes + kPage - 1) / kPage * kPage);
    if (p == nullptr) throw Error("host allocation of " + std::to_string(bytes) + " bytes failed");
    return p;
  }
  void deallocate(void* p, std::size_t bytes) noexcept override {
    if (bytes >= detail::kHugePage) return detail::unmap_huge_aligned(p, bytes);
    std::free(p);
  }
  const char* name() const override { return "aligned"; }
};

}  // namespace

bool HostAllocator::room_for(std::size_t bytes) const {
  const auto m = read_host_memory();
  if (!m) return true;  // not Linux, or unreadable: no reason to hold back
  const std::size_t reserve = host_memory_reserve(*m);
  return m->available >= reserve && m->available - reserve >= bytes;
}

std::string HostAllocator::memory_report() const {
  const auto m = read_host_memory();
  if (!m) return "host memory unknown (/proc/meminfo unreadable)";
  char kept[48];
  std::snprintf(kept, sizeof kept, ", %.1f GiB kept free",
                static_cast<double>(host_memory_reserve(*m)) / (1 << 30));
  return describe(*m) + kept;
}

const char* HostPool::name(Pinning p) {
  switch (p) {
    case Pinning::kOnDemand:
      return "on demand";
    case Pinning::kWhole:
      return "whole";
    case Pinning::kPinning:
      return "pinning";
    case Pinning::kWaitingForMemory:
      return "waiting for memory";
    case Pinning::kStopped:
      return "stopped";
  }
  return "?";
}

std::shared_ptr<HostAllocator> make_aligned_host_allocator() {
  return std::make_shared<AlignedHostAllocator>();
}

HostPool::HostPool(std::size_t slot_bytes, std::int64_t num_slots, std::size_t chunk_bytes,
                   std::shared_ptr<HostAllocator> allocator, Growth growth,
                   std::size_t wanted_align)
    : slot_bytes_(slot_bytes),
      num_slots_(num_slots),
      allocator_(std::move(allocator)),
      growth_(growth) {
  if (slot_bytes == 0) throw std::invalid_argument("host pool: slot_bytes must be positive");
  if (num_slots < 0) throw std::invalid_argument("host pool: num_slots must be >= 0");
  if (!allocator_) throw std::invalid_argument("host pool: allocator required");
  if (slot_bytes > SIZE_MAX / 2) throw std::invalid_argument("host pool: slot_bytes too large");
  if (wanted_align & (wanted_align - 1)) {
    throw std::invalid_argument("host pool: wanted_align must be a power of two (got " +
                                std::to_string(wanted_align) + ")");
  }
  slot_stride_ = (slot_bytes + kSlotAlign - 1) / kSlotAlign * kSlotAlign;
  if (wanted_align > kSlotAlign && wanted_align <= kPage) {
    const std::size_t stride = (slot_bytes + wanted_align - 1) / wanted_align * wanted_align;
    if ((stride - slot_stride_) * 64 <= slot_bytes) {
      slot_stride_ = stride;
      slot_align_ = wanted_align;
    }
  }
  slots_per_chunk_ = static_cast<std::int64_t>(
      std::clamp<std::size_t>(chunk_bytes / slot_stride_, 1, std::size_t{1} << 40));
  // Without rounding up past INT64_MAX (capacity 2**63-1 is a valid "unbounded" pool).
  num_chunks_ = static_cast<std::size_t>(num_slots / slots_per_chunk_ +
                                         (num_slots % slots_per_chunk_ != 0 ? 1 : 0));
  if (growth_ == Growth::kOnDemand || num_chunks_ == 0) return;
  // At start-up, where waiting for the device costs nothing.
  std::unique_lock<std::mutex> lock(mu_);
  const std::size_t upfront = growth_ == Growth::kUpFront ? num_chunks_ : 1;
  for (std::size_t c = 0; c < upfront; ++c) {
    allocate_now(c);
    if (chunks_[c].state == State::kFailed) {
      const std::string why = chunks_[c].failure;
      for (std::size_t d = 0; d < c; ++d) {
        allocator_->deallocate(chunks_[d].data, allocation_size(d));
      }
      chunks_.clear();
      throw Error("allocating the host pool failed at chunk " + std::to_string(c) + " of " +
                  std::to_string(num_chunks_) + ": " + why);
    }
  }
  if (growth_ == Growth::kBackground && num_chunks_ > 1) start_thread();
}

HostPool::~HostPool() {
  {
    std::lock_guard<std::mutex> g(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
  for (std::size_t c = 0; c < chunks_.size(); ++c) {
    if (chunks_[c].data != nullptr) allocator_->deallocate(chunks_[c].data, allocation_size(c));
  }
}

std::size_t HostPool::chunk_size(std::size_t c) const {
  const std::int64_t first = static_cast<std::int64_t>(c) * slots_per_chunk_;
  return static_cast<std::size_t>(std::min(slots_per_chunk_, num_slots_ - first)) * slot_stride_;
}

HostPool::Chunk& HostPool::chunk(std::size_t c) {
  if (c >= chunks_.size()) chunks_.resize(c + 1);
  return chunks_[c];
}

void HostPool::ready(Chunk& ch, std::byte* data, std::size_t bytes) {
  ch.data = data;
  ch.state = State::kReady;
  allocated_bytes_ += bytes;
  // The last chunk: chunks_ holds every chunk and no longer changes, so slot() may read it
  // without the lock from now on.
  if (++ready_chunks_ == num_chunks_) whole_.store(true, std::memory_order_release);
}

void HostPool::allocate_now(std::size_t c) {
  Chunk& ch = chunk(c);
  try {
    ready(ch, static_cast<std::byte*>(allocator_->allocate(allocation_size(c))), chunk_size(c));
  } catch (const std::exception& e) {
    ch.state = State::kFailed;
    ch.failure = e.what();
    last_failure_ = e.what();
  }
}

void HostPool::start_thread() {
  if (!thread_.joinable()) thread_ = std::thread([this] { worker(); });
}

void HostPool::request(std::size_t c) {
  Chunk& ch = chunk(c);
  if (ch.state == State::kReady || ch.state == State::kRequested) return;
  ch.state = State::kRequested;
  queue_.push_back(c);
  start_thread();
  cv_.notify_all();
}

bool HostPool::next_job(std::size_t& c) {
  if (!queue_.empty()) {
    c = queue_.front();
    queue_.erase(queue_.begin());
    return true;
  }
  if (growth_ != Growth::kBackground || sweep_stopped_) return false;
  while (sweep_next_ < num_chunks_ && chunk(sweep_next_).state != State::kNone) ++sweep_next_;
  if (sweep_next_ >= num_chunks_) return false;
  // Too little memory left: wait and look again (memory may be freed, and some VMs grow their
  // memory as it is used); meanwhile a slot asked for still gets its chunk.
  sweep_waiting_ = !allocator_->room_for(allocation_size(sweep_next_));
  if (sweep_waiting_) {
    if (waiting_note_.empty()) waiting_note_ = allocator_->memory_report();  // once a pause
    return false;
  }
  waiting_note_.clear();
  c = sweep_next_++;
  chunk(c).state = State::kRequested;
  return true;
}

void HostPool::worker() {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    std::size_t c = 0;
    while (!stopping_ && !next_job(c)) {
      if (sweep_waiting_) {
        cv_.notify_all();  // wait_idle() returns while the sweep waits for memory
        cv_.wait_for(lock, std::chrono::milliseconds(200));
      } else {
        cv_.wait(lock);
      }
    }
    if (stopping_) return;  // checked before any job is taken: none is left half done
    busy_ = true;
    const std::size_t bytes = chunk_size(c), allocation = allocation_size(c);
    lock.unlock();  // the allocation takes tens of milliseconds: never under the lock
    std::byte* p = nullptr;
    std::string err;
    try {
      p = static_cast<std::byte*>(allocator_->allocate(allocation));
    } catch (const std::exception& e) {
      err = e.what();
    }
    lock.lock();
    busy_ = false;
    Chunk& ch = chunk(c);
    if (p != nullptr) {
      ready(ch, p, bytes);
      sweep_stopped_ = false;  // memory can be had again: the sweep goes on
    } else {
      ch.state = State::kFailed;
      ch.failure = err;
      last_failure_ = err;
      sweep_stopped_ = true;  // likely out of memory: pin more only when asked
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
  const std::size_t offset = static_cast<std::size_t>(i % slots_per_chunk_) * slot_stride_;
  // A store asks for each page's slot: once the pool is whole, without taking the lock.
  if (whole_.load(std::memory_order_acquire)) return chunks_[c].data + offset;
  std::unique_lock<std::mutex> lock(mu_);
  Chunk& ch = chunk(c);
  if (ch.state != State::kReady) {
    if (growth_ == Growth::kOnDemand) {
      allocate_now(c);
    } else if (ch.state == State::kNone) {
      request(c);
      return nullptr;
    } else if (ch.state == State::kRequested) {
      return nullptr;
    }
    if (ch.state == State::kFailed) {
      ch.state = State::kNone;  // a later call asks again
      throw Error(ch.failure);
    }
  }
  return ch.data + offset;
}

void HostPool::wait_idle() {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [&] {
    if (!queue_.empty() || busy_) return false;
    if (growth_ != Growth::kBackground || sweep_stopped_ || sweep_waiting_) return true;
    std::size_t n = sweep_next_;
    while (n < num_chunks_ && (n < chunks_.size() && chunks_[n].state != State::kNone)) ++n;
    return n >= num_chunks_;
  });
}

std::size_t HostPool::allocated_bytes() const {
  std::lock_guard<std::mutex> g(mu_);
  return allocated_bytes_;
}

std::size_t HostPool::total_bytes() const {
  const auto n = static_cast<std::size_t>(num_slots_);
  return n > SIZE_MAX / slot_stride_ ? SIZE_MAX : n * slot_stride_;  // "unbounded" pools
}

HostPool::Status HostPool::status() const {
  std::lock_guard<std::mutex> g(mu_);
  Status s;
  s.allocated_bytes = allocated_bytes_;
  s.total_bytes = total_bytes();
  s.note = last_failure_;
  if (growth_ == Growth::kOnDemand) {
    s.pinning = s.allocated_bytes == s.total_bytes ? Pinning::kWhole : Pinning::kOnDemand;
  } else if (s.allocated_bytes == s.total_bytes) {
    s.pinning = Pinning::kWhole;
  } else if (sweep_stopped_) {
    s.pinning = Pinning::kStopped;
  } else if (sweep_waiting_) {
    s.pinning = Pinning::kWaitingForMemory;
    s.note = "too little host memory to pin ahead of need: " + waiting_note_;
  } else {
    s.pinning = Pinning::kPinning;
  }
  return s;
}

}  // namespace hicache
