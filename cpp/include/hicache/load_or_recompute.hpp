#pragma once
// Load or recompute: how much of a hit is worth loading.
//
// A hit is not free: its pages cross PCIe at the copier's measured rate while the engine could
// be prefilling instead. Given how fast the engine prefills (CacheConfig::prefill_seconds, off
// unless the engine says), the cache serves the prefix length that gives the earliest first
// token:
//   - loaded before the engine starts (try_resume):  load(h) + prefill(h, n)
//   - loaded layer by layer beside the prefill (LayerwiseLoad, L layers): each layer waits for
//     its copies and its compute, so  max(load(h), prefill(h, n)) + min(load(h), prefill(h, n)) / L
// where h is the tokens served, n the prompt's tokens, load(h) = h's bytes / the measured rate
// and prefill(h, n) the engine's time for tokens [h, n) with [0, h) cached.

#include <cstddef>
#include <cstdint>
#include <functional>

namespace hicache {

/// Seconds the engine takes to prefill prompt tokens [start, end) with [0, start) already in
/// its KV cache.
using PrefillSeconds = std::function<double(std::int64_t start, std::int64_t end)>;

struct LoadCost {
  std::int64_t block_tokens = 128;
  std::int64_t prompt_tokens = 0;
  double page_load_s = 0;  ///< one page's bytes over the measured rate
  std::size_t layers = 1;  ///< > 1: loaded layer by layer beside the prefill
  const PrefillSeconds* prefill = nullptr;

  /// Estimated seconds to the first token when the first `pages` pages are served.
  double ttft(std::size_t pages) const;
};

/// The number of pages of a `hit_pages` hit to serve, in [0, hit_pages]: the best of serving
/// nothing, everything, and (layer by layer) where loading and prefilling take equally long,
/// ties to the longer prefix. `whole_or_nothing` (a hybrid model's state exists at one length
/// only) considers 0 and hit_pages alone. Calls prefill O(log hit_pages) times.
std::size_t pages_worth_loading(std::size_t hit_pages, const LoadCost& cost,
                                bool whole_or_nothing = false);

}  // namespace hicache
