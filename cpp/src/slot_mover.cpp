#include "hicache/slot_mover.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <stdexcept>
#include <unordered_set>

#include "hicache/cpu_copier.hpp"
#include "hicache/cuda_copier.hpp"
#include "hicache/error.hpp"

namespace hicache {
namespace {

class SharedMemoryAllocator final : public HostAllocator {
 public:
  SharedMemoryAllocator(std::string name, bool create) : name_(std::move(name)), create_(create) {
    if (name_.empty() || name_.size() > 200 || name_.find('/') != std::string::npos) {
      throw std::invalid_argument("shared memory name must be 1-200 bytes without '/' (got '" +
                                  name_ + "')");
    }
  }
  ~SharedMemoryAllocator() override {
    if (create_ && created_) ::shm_unlink(("/" + name_).c_str());
  }

  void* allocate(std::size_t bytes) override {
    const std::string path = "/" + name_;
    const int fd = ::shm_open(path.c_str(), create_ ? (O_RDWR | O_CREAT) : O_RDWR, 0600);
    if (fd < 0) fail("shm_open");
    if (create_) {
      created_ = true;
      if (::ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
        ::close(fd);
        fail("ftruncate");
      }
    } else {
      struct stat st{};
      if (::fstat(fd, &st) != 0 || static_cast<std::size_t>(st.st_size) != bytes) {
        ::close(fd);
        throw Error("shared memory '" + name_ + "' holds " + std::to_string(st.st_size) +
                    " bytes, not the " + std::to_string(bytes) +
                    " this pool needs (same layout and slot count in every process?)");
      }
    }
    void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    ::close(fd);
    if (p == MAP_FAILED) fail("mmap");
    return p;
  }
  void deallocate(void* p, std::size_t bytes) noexcept override { ::munmap(p, bytes); }
  const char* name() const override { return "shared memory"; }

 private:
  [[noreturn]] void fail(const char* what) const {
    throw Error(std::string(what) + " of shared memory '" + name_ +
                "' failed: " + std::strerror(errno));
  }
  std::string name_;
  bool create_;
  bool created_ = false;
};

std::shared_ptr<Copier> default_copier(Device device) {
  if (device.kind == DeviceKind::kCpu) return std::make_shared<CpuCopier>();
  return make_cuda_copier(device.index);
}

}  // namespace

std::shared_ptr<HostAllocator> make_shared_memory_allocator(const std::string& name, bool create) {
  return std::make_shared<SharedMemoryAllocator>(name, create);
}

SlotMover::SlotMover(
    std::vector<Segment> segments, Device device, std::int64_t num_slots,
    std::shared_ptr<Copier> copier, std::shared_ptr<HostAllocator> memory, std::size_t chunk_bytes,
    bool pin_in_background, std::size_t slot_extra_bytes,
    const std::function<std::shared_ptr<HostAllocator>(std::shared_ptr<HostAllocator>)>&
        wrap_memory)
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
  pool_ = std::make_unique<HostPool>(layout_.page_bytes() + slot_extra_bytes, num_slots,
                                     chunk_bytes, std::move(memory), growth);
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
  std::unordered_set<std::int64_t> seen;
  std::vector<PageMove> moves(slots.size());
  for (std::size_t i = 0; i < slots.size(); ++i) {
    if (slots[i] < 0 || slots[i] >= pool_->num_slots()) {
      throw std::out_of_range("submit: slot " + std::to_string(slots[i]) + " (index " +
                              std::to_string(i) + ") is outside [0, " +
                              std::to_string(pool_->num_slots()) + ")");
    }
    if (dir == Direction::kToHost && !seen.insert(slots[i]).second) {
      throw std::invalid_argument("submit: slot " + std::to_string(slots[i]) +
                                  " is a destination twice");
    }
  }
  for (std::size_t i = 0; i < slots.size(); ++i) {
    std::byte* host = pool_->slot(slots[i]);
    if (host == nullptr) throw Error("submit: slot " + std::to_string(slots[i]) + " has no memory");
    moves[i] = {blocks[i], host};
  }
  std::lock_guard<std::mutex> g(mu_);
  if (!moves.empty()) copier_->copy_pages(dir, layout_, moves, stream);
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
