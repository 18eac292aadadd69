#include "hicache/copier.hpp"

#include <algorithm>
#include <cmath>
#include <string>

#include "hicache/copy_rate.hpp"
#include "hicache/error.hpp"

namespace hicache {

void Copier::copy_segments(Direction dir, const PageLayout& layout, std::span<const PageMove> moves,
                           std::size_t first, std::size_t last, StreamHandle stream) {
  if (first != 0 || last != layout.segments().size()) {
    throw Error(std::string("the '") + path() + "' copier copies whole pages only");
  }
  copy_pages(dir, layout, moves, stream);
}

void CopyRate::add(std::size_t bytes, double seconds) {
  if (bytes == 0 || !(seconds > 0)) return;
  std::lock_guard<std::mutex> g(mu_);
  // Each load at least halves the weight of the ones before it: an engine of short hits follows
  // a link that slowed within a load or two (at 64 MiB a load, a 1 GiB half-life alone took 16).
  const double keep = std::min(0.5, std::exp2(-static_cast<double>(bytes) / half_life_));
  bytes_ = bytes_ * keep + static_cast<double>(bytes);
  seconds_ = seconds_ * keep + seconds;
  last_ = std::chrono::steady_clock::now();
}

double CopyRate::bytes_per_s() const {
  std::lock_guard<std::mutex> g(mu_);
  if (!(seconds_ > 0)) return 0.0;
  const std::chrono::duration<double> age = std::chrono::steady_clock::now() - last_;
  return age.count() > stale_after_ ? 0.0 : bytes_ / seconds_;
}

}  // namespace hicache
