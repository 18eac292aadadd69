#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "../src/huge_pages.hpp"
#include "cuda_check.cuh"
#include "pinned_allocator.hpp"

namespace hicache::cuda {
namespace {

class HostAllocPinned final : public HostAllocator {
 public:
  void* allocate(std::size_t bytes) override {
    void* p = nullptr;
    HICACHE_CUDA_CHECK(cudaHostAlloc(&p, bytes, cudaHostAllocPortable | cudaHostAllocMapped));
    return p;
  }
  void deallocate(void* p, std::size_t) noexcept override { cudaFreeHost(p); }
  const char* name() const override { return "cudaHostAlloc"; }
  bool allocation_is_slow() const override { return true; }
};

// Pinning is bound by faulting pages in, which the driver does on one thread. Faulting them in on
// every core first and then registering the populated range is several times faster.
class RegisteredPinned final : public HostAllocator {
 public:
  explicit RegisteredPinned(int threads)
      : threads_(threads > 0 ? threads : std::max(1u, std::thread::hardware_concurrency())) {}

  void* allocate(std::size_t bytes) override {
    // Huge pages (huge_pages.hpp): faulting the pool in and registering it usually take half the
    // time (copy rates unchanged, BENCHMARKS.md).
    char* p = static_cast<char*>(detail::map_huge_aligned(bytes));
    prefault(p, bytes);
    const cudaError_t err =
        cudaHostRegister(p, bytes, cudaHostRegisterPortable | cudaHostRegisterMapped);
    if (err != cudaSuccess) {
      detail::unmap_huge_aligned(p, bytes);
      throw_cuda_error(err, "cudaHostRegister", __FILE__, __LINE__);
    }
    return p;
  }
  void deallocate(void* p, std::size_t bytes) noexcept override {
    cudaHostUnregister(p);
    detail::unmap_huge_aligned(p, bytes);
  }
  const char* name() const override { return "mmap+cudaHostRegister"; }
  bool allocation_is_slow() const override { return true; }

 private:
  void prefault(char* p, std::size_t bytes) const {
    constexpr std::size_t kPage = 4096;
    const std::size_t n = std::min<std::size_t>(threads_, std::max<std::size_t>(1, bytes >> 26));
    const std::size_t per = (bytes / n + kPage - 1) / kPage * kPage;
    std::vector<std::thread> pool;
    for (std::size_t t = 0; t < n; ++t) {
      pool.emplace_back([=] {
        const std::size_t begin = t * per, end = std::min(bytes, begin + per);
        for (std::size_t off = begin; off < end; off += kPage) p[off] = 0;
      });
    }
    for (auto& th : pool) th.join();
  }
  unsigned threads_;
};

class RegisteredView final : public HostAllocator {
 public:
  explicit RegisteredView(std::shared_ptr<HostAllocator> inner) : inner_(std::move(inner)) {}
  void* allocate(std::size_t bytes) override {
    void* p = inner_->allocate(bytes);
    const cudaError_t err =
        cudaHostRegister(p, bytes, cudaHostRegisterPortable | cudaHostRegisterMapped);
    if (err != cudaSuccess) {
      inner_->deallocate(p, bytes);
      throw_cuda_error(err, "cudaHostRegister", __FILE__, __LINE__);
    }
    return p;
  }
  void deallocate(void* p, std::size_t bytes) noexcept override {
    cudaHostUnregister(p);
    inner_->deallocate(p, bytes);
  }
  const char* name() const override { return "registered with CUDA"; }
  bool allocation_is_slow() const override { return true; }

 private:
  std::shared_ptr<HostAllocator> inner_;
};

}  // namespace

std::shared_ptr<HostAllocator> make_registered_view(std::shared_ptr<HostAllocator> inner) {
  return std::make_shared<RegisteredView>(std::move(inner));
}

std::shared_ptr<HostAllocator> make_pinned_allocator(PinMode mode, int threads) {
  if (mode == PinMode::kHostAlloc) return std::make_shared<HostAllocPinned>();
  return std::make_shared<RegisteredPinned>(threads);
}

}  // namespace hicache::cuda
