// What the index costs a store into a cold pool: null-copier stores of new prompts into a full
// pool of one-page prompts stored in random order (the layout grid's pool), so that every page a
// store inserts evicts one whose entry, table slots and token buffer no recent call touched.
// Nothing is copied: the time is the call's hashing (on its threads), walk and bookkeeping.
// --fill-prompt-pages N fills the pool with prompts of N pages instead (chains, as an engine's
// conversations leave it), stored in random order, so that the stores evict chains' leaves.
//
//   build/<dir>/hicache_bench_store_walk [--pages 1024] [--reps 41] [--block-tokens 16]
//                                        [--pool-pages 65536] [--admission adaptive|always]
//                                        [--fill-prompt-pages 1]
//
// Prints the best and the median of the stores, in ms. Built with -DHICACHE_BUILD_BENCH=ON (no
// CUDA needed). For an A/B, link the same file against each build's library and run them in
// turn several times: on a shared machine one run's median moves by 10-30 %.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <memory>
#include <numeric>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "hicache/hicache.hpp"
#include "probe_args.hpp"

int main(int argc, char** argv) {
  using probe::arg;
  using namespace hicache;
  const long pages = arg(argc, argv, "--pages", 1024L);
  const long reps = arg(argc, argv, "--reps", 41L);
  const long B = arg(argc, argv, "--block-tokens", 16L);
  const long pool = std::max(arg(argc, argv, "--pool-pages", 65536L), pages);
  const std::string admission = arg(argc, argv, "--admission", "adaptive");
  const long fill = arg(argc, argv, "--fill-prompt-pages", 1L);
  if (pages < 1 || reps < 1 || B < 1 || fill < 1 || fill > pool) {
    std::fprintf(stderr,
                 "--pages, --reps, --block-tokens and --fill-prompt-pages must be >= 1, and "
                 "--fill-prompt-pages at most --pool-pages\n");
    return 2;
  }

  const long engine_blocks = std::max(pages, fill);
  std::vector<std::byte> kv(static_cast<std::size_t>(engine_blocks) * 256);  // never touched
  CacheConfig config;
  config.block_tokens = B;
  config.capacity_pages = pool;
  config.admission = parse_admission(admission);
  HostPrefixCache cache({Segment{kv.data(), engine_blocks, 256, 256}}, Device{}, config,
                        std::make_shared<NullCopier>());
  std::vector<std::int64_t> blocks(static_cast<std::size_t>(engine_blocks));
  std::iota(blocks.begin(), blocks.end(), 0);

  std::vector<long> order(static_cast<std::size_t>(pool / fill));
  std::iota(order.begin(), order.end(), 0L);
  std::shuffle(order.begin(), order.end(), std::mt19937(1));
  std::vector<std::int32_t> one(static_cast<std::size_t>(fill * B));
  for (long k : order) {
    for (std::size_t t = 0; t < one.size(); ++t) {
      one[t] = static_cast<int>(k * fill * B + static_cast<long>(t));
    }
    cache.store("fill", one, std::span(blocks).first(static_cast<std::size_t>(fill)));
    cache.poll();
    cache.forget("fill");
  }

  std::vector<double> ms;
  std::vector<std::int32_t> prompt(static_cast<std::size_t>(pages * B + 1));
  for (long r = 0; r < reps; ++r) {
    for (std::size_t t = 0; t < prompt.size(); ++t) {
      prompt[t] = static_cast<std::int32_t>(1'000'000'000 + (r % 100) * 10'000'000 + t);
    }
    const auto t0 = std::chrono::steady_clock::now();
    cache.store("s", prompt, std::span(blocks).first(static_cast<std::size_t>(pages)));
    const auto t1 = std::chrono::steady_clock::now();
    cache.poll();
    cache.forget("s");
    ms.push_back(std::chrono::duration<double, std::milli>(t1 - t0).count());
  }
  const CacheStats stats = cache.stats();
  if (stats.pages_evicted < reps * pages) {
    std::fprintf(stderr, "the stores evicted %lld pages, not %ld: not a cold pool\n",
                 static_cast<long long>(stats.pages_evicted), reps * pages);
    return 1;
  }
  std::sort(ms.begin(), ms.end());
  std::printf(
      "%ld pages of %ld tokens into a full pool of %ld %ld-page prompts (%s): best %.3f "
      "median %.3f ms (%.2f us a page)\n",
      pages, B, pool / fill, fill, admission.c_str(), ms.front(), ms[ms.size() / 2],
      1e3 * ms[ms.size() / 2] / static_cast<double>(pages));
  return 0;
}
