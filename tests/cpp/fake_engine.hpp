#pragma once
// A CPU engine for the GoogleTests of the cache (test_host_prefix_cache.cpp, test_layerwise.cpp).

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>
#include <random>
#include <vector>

#include "hicache/hicache.hpp"

namespace hicache_test {

using hicache::CacheConfig;
using hicache::HostPrefixCache;

// Plays the engine: KV segments in CPU memory, with padding between blocks and canary bytes
// after the last block so out-of-bounds writes are visible.
class FakeEngine {
 public:
  static constexpr std::byte kCanary{0xA5};

  FakeEngine(std::int64_t num_blocks, std::vector<std::int64_t> block_bytes, std::int64_t pad = 0)
      : num_blocks_(num_blocks) {
    for (std::int64_t bytes : block_bytes) {
      const std::int64_t stride = bytes + pad;
      mem_.emplace_back(static_cast<std::size_t>(stride * num_blocks + kGuard), kCanary);
      segments_.push_back({mem_.back().data(), num_blocks, stride, bytes});
    }
  }
  const std::vector<hicache::Segment>& segments() const { return segments_; }
  std::int64_t page_bytes() const {
    std::int64_t n = 0;
    for (const auto& s : segments_) n += s.block_bytes;
    return n;
  }
  void fill(std::int64_t block, std::uint32_t seed) {
    std::mt19937 rng(seed);
    for (const auto& s : segments_) {
      auto* p = static_cast<std::uint8_t*>(s.base) + block * s.block_stride;
      for (std::int64_t i = 0; i < s.block_bytes; ++i) p[i] = static_cast<std::uint8_t>(rng());
    }
  }
  void clear(std::int64_t block) {
    for (const auto& s : segments_) {
      std::memset(static_cast<std::byte*>(s.base) + block * s.block_stride, 0,
                  static_cast<std::size_t>(s.block_bytes));
    }
  }
  std::vector<std::uint8_t> page(std::int64_t block) const {
    std::vector<std::uint8_t> out;
    for (const auto& s : segments_) {
      const auto* p = static_cast<const std::uint8_t*>(s.base) + block * s.block_stride;
      out.insert(out.end(), p, p + s.block_bytes);
    }
    return out;
  }
  bool canaries_intact() const {
    for (std::size_t i = 0; i < mem_.size(); ++i) {
      const auto& s = segments_[i];
      for (std::int64_t b = 0; b < num_blocks_; ++b) {
        for (std::int64_t j = s.block_bytes; j < s.block_stride; ++j) {
          if (mem_[i][static_cast<std::size_t>(b * s.block_stride + j)] != kCanary) return false;
        }
      }
      for (std::size_t j = mem_[i].size() - kGuard; j < mem_[i].size(); ++j) {
        if (mem_[i][j] != kCanary) return false;
      }
    }
    return true;
  }

 private:
  static constexpr std::int64_t kGuard = 64;
  std::int64_t num_blocks_;
  std::vector<std::vector<std::byte>> mem_;
  std::vector<hicache::Segment> segments_;
};

inline HostPrefixCache::AllocateFn give(std::vector<std::int64_t> blocks) {
  return [blocks](std::int64_t n_tokens) -> std::optional<std::vector<std::int64_t>> {
    return std::vector<std::int64_t>(blocks.begin(), blocks.begin() + n_tokens / 16);
  };
}

inline CacheConfig small_config(std::int64_t pages) {
  CacheConfig c;
  c.block_tokens = 16;
  c.capacity_pages = pages;
  return c;
}

}  // namespace hicache_test
