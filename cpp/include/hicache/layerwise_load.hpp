#pragma once
// LayerwiseLoad: a hit loaded layer by layer, so the engine computes layer i while later layers
// are still crossing PCIe.
//
// HostPrefixCache::try_resume(..., &load) enqueues the copies of each layer's segments (the
// groups of CacheConfig::layer_segments, in the engine's layer order) one group after the other
// on the copy stream it was given, with a fence after each. Before layer i's attention reads the
// loaded blocks, the engine calls wait(i, compute_stream): on a GPU its compute stream then waits
// on the device for that layer's copies, and the engine's thread never blocks. Everything
// try_resume promises is unchanged: the same pages, checked the same way, held until poll() sees
// the whole load complete.

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "hicache/copier.hpp"
#include "hicache/device.hpp"

namespace hicache {

class LayerwiseLoad {
 public:
  LayerwiseLoad() = default;

  /// Tokens served, as try_resume returns them (0 on a miss, -1 if allocate deferred).
  std::int64_t tokens() const { return tokens_; }
  /// Layers with a fence: the cache's layer groups on a hit, 0 on a miss (nothing to wait for).
  std::size_t layers() const { return fences_.size(); }
  /// Whether layer `layer`'s copies completed. Non-blocking; true on a miss.
  /// @throws std::out_of_range for a layer beyond layers() on a hit.
  bool ready(std::size_t layer) const;
  /// Makes work enqueued on `stream` after this call wait until layer `layer` is loaded (on a
  /// GPU, without blocking the calling thread). Nothing to do on a miss.
  /// @throws std::out_of_range as ready(); hicache::Error if the device refuses the wait.
  void wait(std::size_t layer, StreamHandle stream) const;
  /// Blocks the calling thread until every layer is loaded.
  void synchronize() const;

 private:
  friend class HostPrefixCache;
  std::int64_t tokens_ = 0;
  std::vector<std::shared_ptr<Fence>> fences_;
  void check(std::size_t layer) const;
};

}  // namespace hicache
