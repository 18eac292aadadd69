#include "hicache/slot_mover.hpp"

#include <algorithm>
#include <stdexcept>

#include "first_repeat.hpp"
#include "hicache/cpu_copier.hpp"
#include "hicache/cuda_copier.hpp"
#include "hicache/error.hpp"

namespace hicache {
namespace {

std::shared_ptr<Copier> default_copier(Device device) {
  if (device.kind == DeviceKind::kCpu) return std::make_shared<CpuCopier>();
  return make_cuda_copier(device.index);
}

}  // namespace

SlotMover::SlotMover(
    std::vector<Segment> segments, Device device, std::int64_t num_slots,
    std::shared_ptr<Copier> copier, std::shared_ptr<HostAllocator> memory, std::size_t chunk_bytes,
    bool pin_in_background, std::size_t slot_extra_bytes,
    const std::function<std::shared_ptr<HostAllocator>(std::shared_ptr<HostAllocator>)>&
        wrap_memory,
    std::size_t slot_align)
    : layout_(std::move(segments), device),
      copier_(copier ? std::move(copier) : default_copier(device)) {
  if (!copier_->supports(device)) {
    throw std::invalid_argument("the copier cannot reach segments on " + device.str());
  }
  if (num_slots < 1) {
    throw std::invalid_argument("num_slots must be >= 1 (got " + std::to_string(num_slots) + ")");
  }
  copier_->bind(layout_);
  if (!memory) {
    memory = copier_->host_allocator();
  } else if (device.kind == DeviceKind::kCuda) {
    memory = make_cuda_registered_allocator(std::move(memory));  // DMA needs pinned memory
  }
  if (wrap_memory) memory = wrap_memory(std::move(memory));
  // Pinning is slow (10-25 GB/s on an H200 host): at construction, or from construction on in
  // the background.
  const auto growth = HostPool::growth_for(*memory, pin_in_background);
  // A state-only layout's pages hold nothing: one byte a slot keeps the pool's arithmetic.
  pool_ =
      std::make_unique<HostPool>(std::max<std::size_t>(layout_.page_bytes() + slot_extra_bytes, 1),
                                 num_slots, chunk_bytes, std::move(memory), growth, slot_align);
}

SlotMover::~SlotMover() {
  std::lock_guard<std::mutex> g(mu_);
  for (Job& j : jobs_) {
    if (j.fence) j.fence->wait();
  }
}

std::int64_t SlotMover::submit(Direction dir, std::span<const std::int64_t> slots,
                               std::span<const std::int64_t> blocks, StreamHandle stream) {
  if (slots.size() != blocks.size()) {
    throw std::invalid_argument("submit: " + std::to_string(slots.size()) + " slots but " +
                                std::to_string(blocks.size()) + " blocks");
  }
  // Destinations must not repeat (two copies into one place race); sources may.
  layout_.check_blocks(blocks, /*require_unique=*/dir == Direction::kToDevice, "submit: blocks");
  // The first bad slot in order decides the error: outside the pool, or (into host memory) a
  // destination named twice.
  std::size_t inside = 0;
  while (inside < slots.size() && slots[inside] >= 0 && slots[inside] < pool_->num_slots()) {
    ++inside;
  }
  if (dir == Direction::kToHost) {
    if (const auto k = detail::first_repeat(slots.first(inside))) {
      throw std::invalid_argument("submit: slot " + std::to_string(slots[*k]) +
                                  " is a destination twice");
    }
  }
  if (inside < slots.size()) {
    throw std::out_of_range("submit: slot " + std::to_string(slots[inside]) + " (index " +
                            std::to_string(inside) + ") is outside [0, " +
                            std::to_string(pool_->num_slots()) + ")");
  }
  std::vector<PageMove> moves(slots.size());
  for (std::size_t i = 0; i < slots.size(); ++i) {
    std::byte* host = pool_->slot(slots[i]);
    if (host == nullptr) throw Error("submit: slot " + std::to_string(slots[i]) + " has no memory");
    moves[i] = {blocks[i], host};
  }
  std::lock_guard<std::mutex> g(mu_);
  if (!moves.empty() && layout_.page_bytes() > 0) copier_->copy_pages(dir, layout_, moves, stream);
  Job job{next_job_++, copier_->record(stream)};
  jobs_.push_back(std::move(job));
  return jobs_.back().id;
}

void SlotMover::poll_locked() {
  for (Job& j : jobs_) {
    if (j.done) continue;
    try {
      j.done = j.fence->done();
    } catch (const Error&) {
      j.done = true;
      j.ok = false;
    }
  }
}

std::vector<SlotMover::Result> SlotMover::finished() {
  std::lock_guard<std::mutex> g(mu_);
  poll_locked();
  std::vector<Result> out;
  for (auto it = jobs_.begin(); it != jobs_.end();) {
    if (!it->done) {
      ++it;
      continue;
    }
    out.push_back({it->id, it->ok});
    it = jobs_.erase(it);
  }
  return out;
}

void SlotMover::wait(std::span<const std::int64_t> ids) {
  std::lock_guard<std::mutex> g(mu_);
  for (Job& j : jobs_) {
    if (std::find(ids.begin(), ids.end(), j.id) != ids.end() && !j.done) {
      j.fence->wait();
      poll_locked();
    }
  }
}

}  // namespace hicache
