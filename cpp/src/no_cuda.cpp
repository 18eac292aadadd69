// Built instead of cpp/cuda/ when CUDA is off: the CUDA copier is reported unavailable.
#include <stdexcept>

#include "hicache/cuda_copier.hpp"

namespace hicache {

bool cuda_available() { return false; }

std::shared_ptr<Copier> make_cuda_copier(int, CudaCopierOptions) {
  throw std::invalid_argument(
      "hicache was built without CUDA: CUDA segments cannot be used (rebuild with the CUDA "
      "toolkit present, or pass CPU tensors)");
}

std::shared_ptr<HostAllocator> make_cuda_registered_allocator(std::shared_ptr<HostAllocator>) {
  throw std::invalid_argument("hicache was built without CUDA: host memory cannot be registered");
}

}  // namespace hicache
