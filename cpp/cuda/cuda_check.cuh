#pragma once
// One checking macro for every CUDA runtime call: throws hicache::Error naming file:line, the
// call and CUDA's message. The policy counts such errors and degrades to a miss.

#include <cuda_runtime.h>

#include <string>

#include "hicache/error.hpp"

namespace hicache::cuda {

[[noreturn]] inline void throw_cuda_error(cudaError_t err, const char* call, const char* file,
                                          int line) {
  throw Error(std::string("CUDA error at ") + file + ":" + std::to_string(line) + ": " + call +
              ": " + cudaGetErrorName(err) + " (" + cudaGetErrorString(err) + ")");
}

}  // namespace hicache::cuda

#define HICACHE_CUDA_CHECK(call)                                                  \
  do {                                                                            \
    cudaError_t hicache_err_ = (call);                                            \
    if (hicache_err_ != cudaSuccess) {                                            \
      ::hicache::cuda::throw_cuda_error(hicache_err_, #call, __FILE__, __LINE__); \
    }                                                                             \
  } while (0)

namespace hicache::cuda {

/// Makes `device` current for a scope and restores the caller's device after: engines call from
/// threads whose current device is their own business.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    HICACHE_CUDA_CHECK(cudaGetDevice(&previous_));
    if (previous_ != device) HICACHE_CUDA_CHECK(cudaSetDevice(device));
  }
  ~DeviceGuard() { cudaSetDevice(previous_); }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = 0;
};

}  // namespace hicache::cuda
