// What the index costs a store into a cold pool: null-copier stores of new prompts into a full
// pool of one-page prompts stored in random order (the layout grid's pool), so that every page a
// store inserts evicts one whose entry, table slots and token buffer no recent call touched.
// Nothing is copied: the time is the call's hashing (on its threads), walk and bookkeeping.
//
//   build/<dir>/hicache_bench_store_walk [--pages 1024] [--reps 41] [--block-tokens 16]
//                                        [--pool-pages 65536] [--admission adaptive|always]
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
  if (pages < 1 || reps < 1 || B < 1) {
    std::fprintf(stderr, "--pages, --reps and --block-tokens must be >= 1\n");
    return 2;
  }

  std::vector<std::byte> kv(static_cast<std::size_t>(pages) * 256);  // never touched
  CacheConfig config;
  config.block_tokens = B;
  config.capacity_pages = pool;
  config.admission = parse_admission(admission);
  HostPrefixCache cache({Segment{kv.data(), pages, 256, 256}}, Device{}, config,
                        std::make_shared<NullCopier>());
  std::vector<std::int64_t> blocks(static_cast<std::size_t>(pages));
  std::iota(blocks.begin(), blocks.end(), 0);

  std::vector<long> order(static_cast<std::size_t>(pool));
  std::iota(order.begin(), order.end(), 0L);
  std::shuffle(order.begin(), order.end(), std::mt19937(1));
  std::vector<std::int32_t> one(static_cast<std::size_t>(B));
  for (long k : order) {
    for (long t = 0; t < B; ++t) one[static_cast<std::size_t>(t)] = static_cast<int>(k * B + t);
    cache.store("fill", one, std::span(blocks).first(1));
    cache.poll();
  }

  std::vector<double> ms;
  std::vector<std::int32_t> prompt(static_cast<std::size_t>(pages * B + 1));
  for (long r = 0; r < reps; ++r) {
    for (std::size_t t = 0; t < prompt.size(); ++t) {
      prompt[t] = static_cast<std::int32_t>(1'000'000'000 + (r % 100) * 10'000'000 + t);
    }
    const auto t0 = std::chrono::steady_clock::now();
    cache.store("s", prompt, blocks);
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
      "%ld pages of %ld tokens into a full pool of %ld one-page prompts (%s): best %.3f "
      "median %.3f ms (%.2f us a page)\n",
      pages, B, pool, admission.c_str(), ms.front(), ms[ms.size() / 2],
      1e3 * ms[ms.size() / 2] / static_cast<double>(pages));
  return 0;
}
