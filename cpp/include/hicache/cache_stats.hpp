#pragma once
// Counters of a HostPrefixCache, a snapshot taken under its lock.

#include <array>
#include <cstdint>
#include <string>

namespace hicache {

/// Latencies in fixed buckets (microseconds), Prometheus-style: counts[i] holds those at most
/// kBoundsUs[i] (and above the bound before); the last count holds those above every bound.
struct LatencyHistogram {
  static constexpr std::array<double, 12> kBoundsUs{10,    30,    100,    300,    1000,    3000,
                                                    10000, 30000, 100000, 300000, 1000000, 3000000};
  std::array<std::int64_t, kBoundsUs.size() + 1> counts{};
  double sum_us = 0;

  void record(double us) {
    std::size_t i = 0;
    while (i < kBoundsUs.size() && us > kBoundsUs[i]) ++i;
    ++counts[i];
    sum_us += us;
  }
  std::int64_t count() const {
    std::int64_t n = 0;
    for (auto c : counts) n += c;
    return n;
  }
};

struct CacheStats {
  // resume
  std::int64_t lookups = 0;        ///< try_resume calls that looked (disabled cache: counted too)
  std::int64_t lookup_tokens = 0;  ///< prompt tokens of those calls
  std::int64_t hits = 0;           ///< calls that returned > 0
  std::int64_t hit_tokens = 0;     ///< tokens served from host memory
  std::int64_t deferred = 0;       ///< calls that returned -1 (allocate refused)
  /// Load or recompute (CacheConfig::prefill_seconds): hits served shorter than found because
  /// recomputing the rest was faster, and the pages left to recompute.
  std::int64_t hits_trimmed = 0;
  std::int64_t pages_recomputed = 0;
  std::int64_t layerwise_loads = 0;  ///< hits loaded layer by layer
  /// The copier's measured load rate (bytes/s; 0 until measured), what the decision uses.
  double load_bytes_per_s = 0;
  // store
  std::int64_t stores = 0;       ///< store calls
  std::int64_t store_skips = 0;  ///< store calls that could not keep every full block (pool busy)
  /// store calls cut short at a slot whose host memory was not pinned yet (pinning in the
  /// background had not caught up); not counted in store_skips
  std::int64_t store_skips_unpinned = 0;
  std::int64_t collisions = 0;  ///< chain keys found holding other tokens
  /// pages not stored because the admission policy declined them (with their descendants in
  /// the same store); not counted in store_skips
  std::int64_t pages_declined = 0;
  /// whether the admission policy declines first sightings now (CacheConfig::admission)
  bool admitting_second_sightings_only = false;
  // transfers. A store's pages and states count once its copy completed (retired by a poll or
  // a later call): as stored if they were published, as discarded if not (the request was
  // forgotten first, the store raised, or the device failed the copy).
  std::int64_t pages_stored = 0;
  std::int64_t pages_discarded = 0;
  std::int64_t pages_loaded = 0;
  std::int64_t pages_evicted = 0;
  std::int64_t states_stored = 0;
  std::int64_t states_discarded = 0;
  std::int64_t states_loaded = 0;
  std::int64_t states_evicted = 0;
  std::int64_t transfers_in_flight = 0;
  // occupancy
  std::int64_t pages_used = 0;
  std::int64_t pages_capacity = 0;
  std::int64_t pages_busy = 0;  ///< held by a transfer or pending their store
  std::int64_t states_used = 0;
  std::int64_t states_capacity = 0;
  std::int64_t states_busy = 0;
  std::int64_t host_bytes = 0;           ///< host memory allocated (pinned, for a GPU cache) so far
  std::int64_t host_bytes_capacity = 0;  ///< what the pools hold once whole
  /// What the pools' memory is doing (HostPool::name(Pinning)): "on demand" (CPU pools),
  /// "whole", "pinning" (the background thread pins the rest), "waiting for memory" (paused:
  /// too little host memory left) or "stopped" (paused after a failed allocation); the least
  /// advanced of the page and state pools.
  std::string pinning;
  /// Why pinning waits or stopped, or the last failed allocation; empty if neither.
  std::string pinning_note;
  std::int64_t requests = 0;  ///< requests known (seen and not forgotten)
  std::int64_t salts = 0;     ///< salts interned: those some cached page uses, and a few more
  /// From the call that enqueued a transfer to the poll (or later call) that found it complete,
  /// so they include how often the engine polls; discarded stores are not counted.
  LatencyHistogram load_latency;
  LatencyHistogram store_latency;
  // shared tier (a Tier given to the cache; all zero without one)
  // Every page a store offers the tier ends written, failed or dropped; queued until then.
  std::int64_t tier_pages_written = 0;  ///< pages the tier confirmed
  std::int64_t tier_pages_failed = 0;   ///< pages whose write the tier refused or failed
  std::int64_t tier_pages_dropped = 0;  ///< not written: the write queue was full
  std::int64_t tier_pages_queued = 0;   ///< offered, not yet written or failed (a gauge)
  std::int64_t tier_pages_fetched = 0;  ///< pages fetched, checked and put in host memory
  std::int64_t tier_hit_tokens = 0;     ///< tokens served that came from the tier
  /// fetched pages whose bytes the device checked where their first load landed (a GPU cache
  /// whose stream had nothing queued before the load); the others are checked on the CPU
  std::int64_t tier_pages_checked_on_device = 0;
  std::int64_t tier_pages_missing = 0;  ///< pages asked for that the tier did not have
  /// values fetched that were not exactly the page asked for (truncated, stale, another
  /// model's, overwritten): misses, never served
  std::int64_t tier_pages_rejected = 0;
  std::int64_t tier_fetches_late = 0;  ///< fetches cut short by their deadline
  std::int64_t tier_errors = 0;  ///< failed tier calls (connection, server); the cache goes on
  std::string tier_last_error;
  // health
  std::int64_t errors = 0;
  bool disabled = false;
  std::string disabled_reason;
  std::string last_error;

  double hit_rate() const { return lookups ? static_cast<double>(hits) / lookups : 0.0; }
  double token_hit_rate() const {
    return lookup_tokens ? static_cast<double>(hit_tokens) / lookup_tokens : 0.0;
  }
};

}  // namespace hicache
