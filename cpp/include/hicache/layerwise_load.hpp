#pragma once
// LayerwiseLoad: a hit loaded layer by layer, so the engine computes layer i while later layers
// are still crossing PCIe.
//
// HostPrefixCache::try_resume(..., &load) enqueues the copies of each layer's segments (the
// groups of CacheConfig::layer_segments, in the engine's layer order) one group after the other
// on the copy stream it was given, with a fence after each. It issues only the first layers
// (CacheConfig::layer_issue_ahead_bytes); wait(i) and ready(i) issue the layers up to i and that
// many bytes beyond, so the engine's thread spends the time of submitting a large hit while its
// prefill runs, not before it starts. Before layer i's attention reads the loaded blocks, the
// engine calls wait(i, compute_stream): on a GPU its compute stream then waits on the device for
// that layer's copies, and the engine's thread never blocks. Everything try_resume promises is
// unchanged: the same pages, checked the same way, held until poll() sees the whole load
// complete.
//
// The copy stream must stay valid until the last layer is issued. Dropping the load (or
// assigning another to it) gives up the layers not yet issued: their blocks are never written,
// and the cache releases the pages once the issued copies complete.

#include <cstddef>
#include <cstdint>
#include <memory>

#include "hicache/device.hpp"

namespace hicache {

namespace detail {
class LayerQueue;
}

class LayerwiseLoad {
 public:
  LayerwiseLoad() = default;
  LayerwiseLoad(LayerwiseLoad&& other) noexcept;
  LayerwiseLoad& operator=(LayerwiseLoad&& other) noexcept;
  LayerwiseLoad(const LayerwiseLoad&) = delete;
  LayerwiseLoad& operator=(const LayerwiseLoad&) = delete;
  ~LayerwiseLoad();

  /// Tokens served, as try_resume returns them (0 on a miss, -1 if allocate deferred).
  std::int64_t tokens() const { return tokens_; }
  /// Layers with a fence: the cache's layer groups on a hit, 0 on a miss (nothing to wait for).
  std::size_t layers() const;
  /// Whether layer `layer`'s copies completed (issuing them if they were not). Non-blocking;
  /// true on a miss.
  /// @throws std::out_of_range for a layer beyond layers() on a hit; hicache::Error if its
  /// copies could not be issued or the cache was destroyed first (the hit is then lost from that
  /// layer on: recompute the request).
  bool ready(std::size_t layer) const;
  /// Makes work enqueued on `stream` after this call wait until layer `layer` is loaded (on a
  /// GPU, without blocking the calling thread), issuing its copies first if needed. Nothing to
  /// do on a miss.
  /// @throws as ready(); hicache::Error also if the device refuses the wait.
  void wait(std::size_t layer, StreamHandle stream) const;
  /// Issues what is left and blocks the calling thread until every layer is loaded.
  /// @throws hicache::Error as ready().
  void synchronize() const;

 private:
  friend class HostPrefixCache;
  std::int64_t tokens_ = 0;
  std::shared_ptr<detail::LayerQueue> queue_;  // null on a miss
};

}  // namespace hicache
