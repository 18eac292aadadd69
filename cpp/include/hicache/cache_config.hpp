#pragma once
// What an engine tells the cache at construction.

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "hicache/admission_policy.hpp"
#include "hicache/load_or_recompute.hpp"
#include "hicache/prefix_index.hpp"
#include "hicache/tier.hpp"

namespace hicache {

/// Blocks between a prompt's last boundary and the j-th boundary whose state store() saves:
/// 0, 1, 2, 4, 8, ... (a branch d blocks back loses at most about d more blocks).
constexpr std::int64_t state_boundary_distance(std::int64_t j) {
  return j < 2 ? j : std::int64_t{1} << (j - 1);
}

struct CacheConfig {
  /// Tokens per engine KV block (= per host page).
  std::int64_t block_tokens = 128;
  /// Host page slots (the pool holds capacity_pages * page_bytes).
  std::int64_t capacity_pages = 0;
  /// At least this many prompt tokens are always left to recompute on a hit (>= 1: the last
  /// token must run to produce logits; hybrid models need their bounded-replay suffix).
  std::int64_t keep_tokens = 1;
  /// Bytes of one per-sequence state (0: the model has none and states are off).
  std::int64_t state_bytes = 0;
  /// A state made of several buffers (see state_buffers.hpp): the bytes of each part, in order.
  /// Empty: one part of state_bytes. Given, state_bytes must be 0 (it becomes their sum) or
  /// their sum.
  std::vector<std::int64_t> state_parts;
  /// Host state slots.
  std::int64_t capacity_states = 0;
  /// store() saves states at this many of the prompt's block boundaries, spaced geometrically
  /// back from the last one (state_boundary_distance): 4 = the last boundary and those 1, 2 and
  /// 4 blocks before it. A prompt that branches off an earlier one resumes at the last of these
  /// within the pages they share (none within: nothing is served). See docs/hybrid.md.
  std::int64_t state_lookback = 4;
  /// Root of every chain unless a call passes its own (tenant namespace).
  std::string salt;
  /// Consecutive cache failures after which the cache disables itself.
  std::int64_t error_limit = 8;
  /// Which idle page gives up its slot when the pool is full (states always use kLru).
  EvictionPolicy eviction = EvictionPolicy::kLeafFirst;
  /// Which new pages may take a slot (see admission_policy.hpp). kAdaptive: write-through for
  /// pools that hold the workload's reuse, second sightings only for small pools under pressure.
  Admission admission = Admission::kAdaptive;
  /// Tests only: keep this many bits of each chain key (128 = the real hash). Fewer bits make
  /// collisions common, to show that exact matching never serves another prefix's page.
  /// Refused with a tier: a tier's record names a page's prefix only by its parent's key.
  int key_bits = 128;
  /// Target size of one host allocation (pinning runs fastest in large chunks: 11.5 GB/s with
  /// 1 GiB against 5.2 GB/s with 256 MiB, measured on an H200 host).
  std::size_t pool_chunk_bytes = std::size_t{1} << 30;
  /// Pinned pools (CUDA): false (default) pins the first chunk at construction and the rest on a
  /// background thread, chunk after chunk, until the pool is whole (pausing while host memory is
  /// short, see HostAllocator::room_for); stores that outrun the pinning skip (best effort,
  /// counted in store_skips_unpinned). true pins the whole pool at construction (13 GB/s
  /// measured on an H200 host). CPU pools always grow on demand.
  bool pin_upfront = false;
  /// How a shared tier given to the cache is used (ignored without one).
  TierOptions tier;
  /// Layer-wise loads (layerwise_load.hpp): the segments of each layer, in the engine's layer
  /// order (e.g. {2, 2, ...}: K and V per layer; {1, 1, ...}: one MLA latent tensor per layer);
  /// they must add up to the number of segments. Empty: layer-wise loads are refused.
  std::vector<std::int64_t> layer_segments;
  /// Layer-wise loads: try_resume issues the first layer's copies and this many bytes of the
  /// layers after it; LayerwiseLoad::wait(i) issues through layer i and this many bytes beyond.
  /// Submitting copies costs the engine's thread time (13 ms for a 43K-token hit of a
  /// Llama-3-8B-shaped pool on an H200, all at once), which this moves from before the prefill
  /// into it. 512 MiB keeps about 10 ms of copies queued at 55 GB/s ahead of the layer the engine
  /// waits for. SIZE_MAX issues everything in try_resume.
  std::size_t layer_issue_ahead_bytes = std::size_t{512} << 20;
  /// How fast the engine prefills (load_or_recompute.hpp). Given, try_resume serves only as much
  /// of a hit as gives an earlier first token than recomputing it, at the copier's measured rate
  /// (counted in pages_recomputed). Empty (default): every hit is served whole.
  PrefillSeconds prefill_seconds;

  /// @throws std::invalid_argument naming the first bad field.
  void validate() const;
  /// The bytes of each part of a state (state_parts, or {state_bytes}; empty without states).
  std::vector<std::int64_t> state_part_bytes() const;
  /// A validated copy with state_bytes the sum of state_parts. @throws as validate().
  CacheConfig normalized() const;
};

}  // namespace hicache
