#pragma once
// Where memory lives, and the opaque stream handle the engine passes in.

#include <cstddef>
#include <string>

namespace hicache {

enum class DeviceKind { kCpu, kCuda };

struct Device {
  DeviceKind kind = DeviceKind::kCpu;
  int index = 0;

  friend bool operator==(const Device& a, const Device& b) {
    return a.kind == b.kind && (a.kind == DeviceKind::kCpu || a.index == b.index);
  }
  std::string str() const {
    return kind == DeviceKind::kCpu ? std::string("cpu") : "cuda:" + std::to_string(index);
  }
};

/// A CUDA stream (cudaStream_t) passed as an opaque pointer so the public headers need no CUDA
/// include; nullptr is the legacy default stream. Ignored by the CPU copier.
using StreamHandle = void*;

/// A contiguous buffer owned by the engine (a state staging tensor, for instance).
struct DeviceBuffer {
  void* data = nullptr;
  std::size_t bytes = 0;
  Device device{};
};

}  // namespace hicache
