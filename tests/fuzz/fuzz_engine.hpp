#pragma once
// What the C++ fuzz targets share (fuzz_cache.cpp, fuzz_tier.cpp): a toy engine of one segment
// whose blocks hold the "KV" of their prefix, the prompts and block tables an input decodes
// into, and how a target reports a broken invariant.

#include <fuzzer/FuzzedDataProvider.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

namespace hicache_fuzz {

/// The target's name in what fail() prints (each target defines it).
extern const char* const kTarget;

/// A broken invariant: says which, and aborts (libFuzzer keeps the input that did it).
[[noreturn]] inline void fail(const char* what) {
  std::fprintf(stderr, "%s: %s\n", kTarget, what);
  std::abort();
}

constexpr std::int64_t kB = 4;        // tokens per block
constexpr std::int64_t kBlocks = 12;  // engine blocks
constexpr std::int64_t kBytes = 8;    // bytes per block (one segment)

/// The "model": the KV (or state) of the first `end` tokens of `t`. `salt` stands for another
/// tenant's model, so a page that crossed from one salt to another fails the check.
inline std::uint64_t digest(const std::vector<std::int32_t>& t, std::size_t end, int salt = 0) {
  std::uint64_t h = 1469598103934665603ull ^ static_cast<std::uint64_t>(salt);
  for (std::size_t i = 0; i < end; ++i)
    h = (h ^ static_cast<std::uint32_t>(t[i])) * 1099511628211ull;
  return h;
}

/// 1-5 pages drawn from four (two sharing their first three tokens), then 0-3 tokens more.
inline std::vector<std::int32_t> decode_prompt(FuzzedDataProvider& fdp) {
  static constexpr std::int32_t kPages[4][kB] = {
      {1, 2, 3, 4}, {5, 6, 7, 8}, {1, 2, 3, 5}, {9, 9, 9, 9}};
  std::vector<std::int32_t> prompt;
  for (int p = fdp.ConsumeIntegralInRange(1, 5); p > 0; --p) {
    const auto& page = kPages[fdp.ConsumeIntegralInRange(0, 3)];
    prompt.insert(prompt.end(), page, page + kB);
  }
  for (int t = fdp.ConsumeIntegralInRange(0, 3); t > 0; --t) prompt.push_back(t);
  return prompt;
}

/// A well-formed block table for a prompt of `tokens` (distinct, in range, one a page and one
/// for the partial page), rotated by `shift` so that pages land in other blocks than they left.
inline std::vector<std::int64_t> rotated_block_table(std::size_t tokens, std::int64_t shift) {
  std::vector<std::int64_t> ids;
  for (std::int64_t i = 0; i <= static_cast<std::int64_t>(tokens) / kB && i < kBlocks; ++i)
    ids.push_back((i + shift) % kBlocks);
  return ids;
}

}  // namespace hicache_fuzz
