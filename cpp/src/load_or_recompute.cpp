#include "hicache/load_or_recompute.hpp"

#include <algorithm>

namespace hicache {

double LoadCost::ttft(std::size_t pages) const {
  const auto h = static_cast<std::int64_t>(pages) * block_tokens;
  const double load = static_cast<double>(pages) * page_load_s;
  const double compute = (*prefill)(h, prompt_tokens);
  if (layers <= 1) return load + compute;
  return std::max(load, compute) + std::min(load, compute) / static_cast<double>(layers);
}

std::size_t pages_worth_loading(std::size_t hit_pages, const LoadCost& cost,
                                bool whole_or_nothing) {
  if (hit_pages == 0 || cost.prefill == nullptr || !*cost.prefill || !(cost.page_load_s > 0)) {
    return hit_pages;
  }
  std::size_t best = hit_pages;
  double best_s = cost.ttft(hit_pages);
  auto consider = [&](std::size_t pages) {
    const double s = cost.ttft(pages);
    if (s < best_s || (s == best_s && pages > best)) {
      best = pages;
      best_s = s;
    }
  };
  consider(0);
  if (whole_or_nothing || cost.layers <= 1) return best;
  // Loading grows with h and prefilling shrinks: the first h where the load takes at least as
  // long as the rest of the prefill, and the page before it, bracket the overlapped optimum.
  std::size_t lo = 0, hi = hit_pages;
  auto load_dominates = [&](std::size_t pages) {
    return static_cast<double>(pages) * cost.page_load_s >=
           (*cost.prefill)(static_cast<std::int64_t>(pages) * cost.block_tokens,
                           cost.prompt_tokens);
  };
  if (!load_dominates(hi)) return best;  // the load never catches up: serving all is best
  while (hi - lo > 1) {
    const std::size_t mid = lo + (hi - lo) / 2;
    (load_dominates(mid) ? hi : lo) = mid;
  }
  consider(lo);
  consider(hi);
  return best;
}

}  // namespace hicache
