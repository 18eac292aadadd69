#pragma once
// Replays a trace of prompts, given as page ids, through the cache's policy at memory speed.
//
// `hicache replay` runs traces of billions of tokens: hashing every page (BLAKE2b, ~0.7 us) and
// going through the engine-facing API would cost more than the policy itself. A trace's block
// ids already identify prefixes (equal ids mean an equal prefix up to there), so pages are keyed
// by their ids and run through the real PrefixIndex and AdmissionPolicy with the rules of
// HostPrefixCache::try_resume and store (a test checks both give the same result on a trace).
// The offline optimum (Belady) runs over the same pages and the same hit rule.

#include <cstdint>
#include <span>
#include <vector>

#include "hicache/admission_policy.hpp"
#include "hicache/key.hpp"
#include "hicache/prefix_index.hpp"

namespace hicache {

/// Pages of request r are pages[offsets[r] .. offsets[r+1]); a page is (block id, sub-page):
/// two pages are the same prefix iff both are equal.
struct ReplayTrace {
  std::span<const std::uint64_t> block_ids;
  std::span<const std::uint32_t> sub_pages;
  std::span<const std::int64_t> offsets;  ///< requests + 1 entries
  /// Pages of request r a hit may cover (the hit rule: keep_tokens left to compute).
  std::span<const std::int64_t> hit_limit;
};

struct ReplayResult {
  std::vector<std::int64_t> served_pages;  ///< per request
  std::vector<std::int64_t> tier_pages;    ///< replay_shared: of those, from the shared tier
  std::int64_t requests_hit = 0;
  std::int64_t pages_stored = 0;  ///< pages written to host memory
  std::int64_t pages_declined = 0;
  std::int64_t evictions = 0;
  std::int64_t tier_pages_stored = 0;  ///< replay_shared: pages written to the shared tier
};

/// The key a replayed page gets: injective in (block id, sub-page), uniform in its first bytes.
Key replay_key(std::uint64_t block_id, std::uint32_t sub_page);

/// Runs every request as try_resume then store (write-through after prefill) with a null copier.
/// @throws std::invalid_argument for inconsistent spans or capacity < 1.
ReplayResult replay_policy(const ReplayTrace& trace, std::int64_t capacity_pages,
                           EvictionPolicy eviction, Admission admission);

/// When pages reach a shared tier.
enum class TierWrite {
  kThrough,  ///< each page a host stores, when it stores it (as HostPrefixCache writes its tier)
  kBack,     ///< a page when a host evicts it
};

/// How the tier drops pages when it is full.
enum class TierModelKind {
  kLru,   ///< least recently used page first (a Mooncake Store's objects)
  kDisk,  ///< DiskTier's rule: oldest segment (1/16 of the capacity) first, a page read from
          ///< the older half written again at the head
};

/// Several engine instances, each with a private host pool (`policy`, `host_capacity_pages`),
/// over one shared tier of `tier_capacity_pages` (0: none; `kind` drops its pages). Request r runs
/// on instance instance_of[r]: its host pool serves the longest cached prefix, the tier the pages
/// it holds right after that (a host miss waits for the tier), then the prompt is stored in the
/// host and, per `write`, its pages (or those the host evicted) in the tier.
/// @throws std::invalid_argument for a bad instance, count or capacity.
ReplayResult replay_shared(const ReplayTrace& trace, std::span<const std::int32_t> instance_of,
                           std::int32_t instances, std::int64_t host_capacity_pages,
                           std::int64_t tier_capacity_pages, EvictionPolicy eviction,
                           Admission admission, TierWrite write = TierWrite::kThrough,
                           TierModelKind kind = TierModelKind::kLru);

/// Belady: evicts the page used farthest in the future and declines a page used later than every
/// cached one; ties go to the deeper page, so no page is evicted before its descendants.
ReplayResult replay_optimum(const ReplayTrace& trace, std::int64_t capacity_pages);

}  // namespace hicache
