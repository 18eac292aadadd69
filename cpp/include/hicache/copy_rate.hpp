#pragma once
// CopyRate: a copier's measured rate, for the load-or-recompute decision (load_or_recompute.hpp).

#include <chrono>
#include <cstddef>
#include <mutex>

namespace hicache {

/// Bytes over seconds of recent copies (the time a load really took, waits behind other streams'
/// copies included): earlier measurements fade by half with every `half_life_bytes` measured
/// after them, and at least by half with each new one, so the rate follows a link that became
/// slower (a competing copy) within a load or two. A rate not measured for `stale_after_s` is
/// forgotten (0): a cache that declined every hit on a slow link measures again once the link may
/// have recovered. Thread-safe.
class CopyRate {
 public:
  explicit CopyRate(double half_life_bytes = double(std::size_t{1} << 30),
                    double stale_after_s = 5.0)
      : half_life_(half_life_bytes), stale_after_(stale_after_s) {}
  void add(std::size_t bytes, double seconds);
  /// 0 until something was measured, and once the last measurement is stale.
  double bytes_per_s() const;

 private:
  double half_life_;
  double stale_after_;
  mutable std::mutex mu_;
  double bytes_ = 0;  // decayed
  double seconds_ = 0;
  std::chrono::steady_clock::time_point last_{};
};

}  // namespace hicache
