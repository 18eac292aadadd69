#pragma once
// Waiting for a tier's batch: what TierLink and PageStore both do with a backend that may or
// may not block in wait(). Internal.

#include <chrono>
#include <cstdint>
#include <mutex>
#include <optional>
#include <vector>

#include "hicache/tier.hpp"

namespace hicache::detail {

/// Polls `batch` (under `tier_mu`, which serialises the tier's calls) until it completed, then
/// returns its results; nullopt once `deadline` passed. Between polls it calls the tier's
/// wait() without the lock (another thread may use the tier meanwhile), at most a second at a
/// time, so that a backend that misses a completion costs a poll, not a hang; a backend that
/// cannot block (or whose wait() returned with the batch still running) is polled with pauses
/// growing from 5 to 100 us instead of being spun on.
std::optional<std::vector<std::int64_t>> wait_for_batch(
    Tier& tier, std::mutex& tier_mu, std::int64_t batch,
    std::chrono::steady_clock::time_point deadline);

}  // namespace hicache::detail
