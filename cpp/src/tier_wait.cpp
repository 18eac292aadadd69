#include "tier_wait.hpp"

#include <algorithm>
#include <thread>

namespace hicache::detail {

std::optional<std::vector<std::int64_t>> wait_for_batch(
    Tier& tier, std::mutex& tier_mu, std::int64_t batch,
    std::chrono::steady_clock::time_point deadline) {
  using Clock = std::chrono::steady_clock;
  auto pause = std::chrono::microseconds(5);
  bool waited = false;  // the last try ended in a wait() that said it blocked
  for (;;) {
    {
      std::lock_guard<std::mutex> t(tier_mu);
      if (auto r = tier.poll(batch)) return r;
    }
    const auto now = Clock::now();
    if (now >= deadline) return std::nullopt;
    // Without tier_mu: another thread may put or fetch meanwhile. At most a second at a time,
    // so that a backend that misses a completion costs a poll, not a hang. After a wait that
    // ended with the batch still running, a pause: a backend whose wait() returns at once while
    // saying it blocked is then polled as one that cannot block, instead of spinning.
    if (!waited) {
      const auto left = std::min<Clock::duration>(deadline - now, std::chrono::seconds(1));
      waited = tier.wait(batch, std::chrono::ceil<std::chrono::microseconds>(left));
      if (waited) continue;
    }
    waited = false;
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::microseconds(100));
  }
}

}  // namespace hicache::detail
