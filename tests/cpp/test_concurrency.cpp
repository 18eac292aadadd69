// Several engine threads on one hybrid cache (pages + states), checked against the truth: every
// hit's pages and state must be exactly those of the prompt's prefix under the call's salt. The
// state pool is small, so states are evicted and their slots reused all the time while other
// threads load, store and forget. Runs in the plain, ASan+UBSan and TSan builds.
#include <gtest/gtest.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <list>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "fake_engine.hpp"
#include "hicache/hicache.hpp"

namespace {

using hicache::CacheConfig;
using hicache::DeviceBuffer;
using hicache::HostPrefixCache;
using hicache_test::FakeEngine;

constexpr std::int64_t kBlockTokens = 4;
constexpr std::int64_t kPageBytes = 32;
constexpr std::int64_t kStateBytes = 16;
constexpr std::int64_t kBlocksPerThread = 8;  // prompts of up to 6 pages, and a spare

// What the engine holds after prefilling tokens [0, end) of `prompt` under `salt`: a digest of
// the whole prefix (a page's KV depends on every token before it), `n` bytes of it.
std::vector<std::uint8_t> digest(const std::vector<std::int32_t>& prompt, std::size_t end,
                                 const std::string& salt, std::uint64_t seed, std::size_t n) {
  std::uint64_t h = 0xcbf29ce484222325ULL ^ seed;
  auto mix = [&](std::uint64_t v) {
    h ^= v;
    h *= 0x100000001b3ULL;
    h ^= h >> 29;
  };
  for (char c : salt) mix(static_cast<unsigned char>(c) + 1000);
  for (std::size_t i = 0; i < end; ++i) mix(static_cast<std::uint64_t>(prompt[i]));
  std::vector<std::uint8_t> out(n);
  for (std::size_t i = 0; i < n; ++i) {
    mix(i);
    out[i] = static_cast<std::uint8_t>(h >> 24);
  }
  return out;
}

std::vector<std::uint8_t> page_bytes(const std::vector<std::int32_t>& prompt, std::size_t page,
                                     const std::string& salt) {
  return digest(prompt, (page + 1) * kBlockTokens, salt, 1, kPageBytes);
}

std::vector<std::uint8_t> state_bytes(const std::vector<std::int32_t>& prompt, std::size_t end,
                                      const std::string& salt) {
  return digest(prompt, end, salt, 2, kStateBytes);
}

struct Outcome {
  std::atomic<int> hits{0}, wrong_pages{0}, wrong_states{0}, stores{0};
};

// `skew`: the engine exports the state `skew` tokens before the position asked for (0: right).
void engine_thread(HostPrefixCache& cache, FakeEngine& eng, int th, int ops, Outcome& out,
                   std::int64_t skew = 0) {
  std::mt19937 rng(static_cast<std::uint32_t>(1234 + th));
  const std::int64_t base = kBlocksPerThread * th;
  std::vector<std::uint8_t> state_out(kStateBytes);
  for (int i = 0; i < ops; ++i) {
    const std::string id = std::to_string(th) + ":" + std::to_string(i);
    const std::string salt = rng() % 2 ? "tenant-b" : "";
    // Overlapping prompts: 1-6 pages over a 2-letter alphabet, and a partial last block.
    const std::size_t pages = 1 + rng() % 6;
    std::vector<std::int32_t> prompt(pages * kBlockTokens + 1 + rng() % 3);
    for (auto& t : prompt) t = static_cast<std::int32_t>(1 + rng() % 2);
    std::vector<std::int64_t> blocks;
    for (std::int64_t b = 0; b < kBlocksPerThread; ++b) blocks.push_back(base + b);
    if (rng() % 2) {
      // Prefill: the engine's blocks and its state at every boundary, from the prompt.
      for (std::size_t p = 0; p < pages; ++p) {
        const auto bytes = page_bytes(prompt, p, salt);
        for (std::int64_t k = 0; k < kPageBytes; ++k) {
          *(static_cast<std::uint8_t*>(eng.segments()[0].base) +
            blocks[p] * eng.segments()[0].block_stride + k) = bytes[static_cast<std::size_t>(k)];
        }
      }
      // A fresh buffer for every position, freed once the store returned (the contract).
      std::list<std::vector<std::uint8_t>> exported;
      auto state_export = [&](std::int64_t pos) -> std::optional<hicache::StateBuffers> {
        exported.push_back(state_bytes(prompt, static_cast<std::size_t>(pos - skew), salt));
        return hicache::StateBuffers{
            {DeviceBuffer{exported.back().data(), static_cast<std::size_t>(kStateBytes), {}}}};
      };
      cache.store(id, prompt, blocks, nullptr, state_export, salt);
      ++out.stores;
    } else {
      std::fill(state_out.begin(), state_out.end(), 0xEE);
      const std::int64_t got = cache.try_resume(
          id, prompt,
          [&](std::int64_t tokens) {
            return std::optional<std::vector<std::int64_t>>(
                std::vector<std::int64_t>(blocks.begin(), blocks.begin() + tokens / kBlockTokens));
          },
          nullptr,
          hicache::StateBuffers{
              {DeviceBuffer{state_out.data(), static_cast<std::size_t>(kStateBytes), {}}}},
          salt);
      if (got > 0) {
        ++out.hits;
        for (std::int64_t p = 0; p < got / kBlockTokens; ++p) {
          if (eng.page(blocks[static_cast<std::size_t>(p)]) !=
              page_bytes(prompt, static_cast<std::size_t>(p), salt)) {
            ++out.wrong_pages;
          }
        }
        // Copies are synchronous on the CPU: state_out holds the state of exactly prompt[:got].
        if (state_out != state_bytes(prompt, static_cast<std::size_t>(got), salt)) {
          ++out.wrong_states;
        }
      }
    }
    if (rng() % 3 == 0) cache.poll();
    cache.forget(id);
  }
}

}  // namespace

TEST(Concurrency, HybridHitsServeExactlyTheirPrefixsPagesAndStateUnderEightThreads) {
  constexpr int kThreads = 8;
  FakeEngine eng(kThreads * kBlocksPerThread, {kPageBytes});
  CacheConfig c;
  c.block_tokens = kBlockTokens;
  c.capacity_pages = 24;
  c.state_bytes = kStateBytes;
  c.capacity_states = 8;  // far fewer than the prefixes in play: states are evicted constantly
  c.state_lookback = 3;
  HostPrefixCache cache(eng.segments(), {}, c);
  Outcome out;
  std::vector<std::thread> threads;
  for (int th = 0; th < kThreads; ++th) {
    threads.emplace_back([&, th] { engine_thread(cache, eng, th, 2500, out); });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(out.wrong_pages.load(), 0);
  EXPECT_EQ(out.wrong_states.load(), 0);
  const auto s = cache.stats();
  EXPECT_GT(out.hits.load(), 1000) << "too few hits to have raced";
  EXPECT_GT(s.states_evicted, 1000) << "the state pool must turn over";
  EXPECT_EQ(s.pages_busy, 0);
  EXPECT_EQ(s.states_busy, 0);
  EXPECT_EQ(s.requests, 0);
  EXPECT_TRUE(eng.canaries_intact());
}

TEST(Concurrency, TheHarnessCatchesAStateOfAnotherPosition) {
  // Negative control: an engine that exports the state one block early (what a slot reused
  // under a copy, or a buffer freed before it was read, would serve) fails the same check.
  FakeEngine eng(kBlocksPerThread, {kPageBytes});
  CacheConfig c;
  c.block_tokens = kBlockTokens;
  c.capacity_pages = 24;
  c.state_bytes = kStateBytes;
  c.capacity_states = 8;
  c.state_lookback = 2;
  HostPrefixCache cache(eng.segments(), {}, c);
  Outcome out;
  engine_thread(cache, eng, 0, 400, out, /*skew=*/kBlockTokens);
  EXPECT_GT(out.hits.load(), 20);
  EXPECT_EQ(out.wrong_states.load(), out.hits.load());
  EXPECT_EQ(out.wrong_pages.load(), 0);
}
