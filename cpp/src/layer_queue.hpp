#pragma once
// LayerQueue (internal): the copies of one layer-wise load, issued a few layers ahead of the
// engine instead of all at once.
//
// Enqueuing a large hit is not free: on an H200 a 43K-token hit of a Llama-3-8B-shaped pool is
// 21,504 DMA pieces (336 pages x 64 segments), and submitting them took 13 ms of the engine's
// thread, during which it could not start the prefill (the demo's agentic workload, median).
// So try_resume issues only the first layers, and each LayerwiseLoad::wait / ready issues the
// layers up to the one asked for plus `ahead_bytes` more. The copies of a layer are always issued
// before anything waits on its fence: a stream is never made to wait for work not yet submitted
// (a scheduler thread that did that deadlocked against a synchronous copy on the waiting stream;
// docs/layerwise.md).
//
// Locking: issuing uses the cache's copier and counters, so every call here runs under the
// cache's mutex, which the queue shares (the LayerwiseLoad may outlive the cache). The cache calls
// done() and wait() with that mutex held; the engine side (fence, abandon) takes it.

#include <cstddef>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "hicache/copier.hpp"
#include "hicache/page_layout.hpp"

namespace hicache::detail {

class LayerQueue final : public Fence {
 public:
  struct Plan {
    Copier* copier = nullptr;
    const PageLayout* layout = nullptr;
    std::vector<PageMove> moves;
    std::vector<std::size_t> layer_starts;  // first segment of each layer, and the end
    StreamHandle stream = nullptr;
    std::size_t ahead_bytes = 0;  // issued beyond the layer asked for (SIZE_MAX: everything)
    std::function<void(const std::string&)> on_error;  // the cache counts it (mutex held)
  };

  LayerQueue(std::shared_ptr<std::mutex> mutex, Plan plan);

  std::size_t layers() const { return plan_.layer_starts.size() - 1; }

  // --- the cache's side, its mutex held ---
  /// Issues layer 0 and `ahead_bytes` after it. @throws hicache::Error as the copier does (not
  /// counted: the caller counts it).
  void start();
  /// Every layer issued and complete (a load given up or cut short: what was issued).
  bool done() override;
  /// The cache is going away: issues nothing more and blocks until the issued copies completed.
  void wait() noexcept override;

  // --- the engine's side: takes the mutex ---
  /// Layer `layer`'s fence, once its copies and `ahead_bytes` after them are issued.
  /// @throws hicache::Error if the cache is gone or a copy could not be issued (the load is then
  /// lost from that layer on: the engine must recompute).
  std::shared_ptr<Fence> fence(std::size_t layer);
  /// The engine dropped its load: the layers not yet issued never will be, so the cache can
  /// release the pages once the issued copies complete.
  void abandon() noexcept;

 private:
  void issue_through(std::size_t layer);  // mutex held; @throws hicache::Error
  std::size_t layer_bytes(std::size_t layer) const;

  std::shared_ptr<std::mutex> mutex_;
  Plan plan_;
  std::vector<std::shared_ptr<Fence>> fences_;  // of the layers issued so far
  bool closed_ = false;                         // nothing more will be issued
  bool unfenced_ = false;                       // a copy without a fence: never done
  std::string failure_;                         // why, if a copy could not be issued
};

}  // namespace hicache::detail
