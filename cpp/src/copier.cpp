#include "hicache/copier.hpp"

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
  const double keep = std::exp2(-static_cast<double>(bytes) / half_life_);
  // The rates of the copies, averaged with their bytes as weights.
  const auto b = static_cast<double>(bytes);
  bytes_ = bytes_ * keep + b;
  weighted_ = weighted_ * keep + b * (b / seconds);
  last_ = std::chrono::steady_clock::now();
}

double CopyRate::bytes_per_s() const {
  std::lock_guard<std::mutex> g(mu_);
  if (!(bytes_ > 0)) return 0.0;
  const std::chrono::duration<double> age = std::chrono::steady_clock::now() - last_;
  return age.count() > stale_after_ ? 0.0 : weighted_ / bytes_;
}

}  // namespace hicache
