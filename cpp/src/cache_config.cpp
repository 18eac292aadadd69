#include "hicache/cache_config.hpp"

#include <numeric>
#include <stdexcept>
#include <string>

namespace hicache {
namespace {

void require(bool ok, const char* field, const std::string& rule, std::int64_t value) {
  if (!ok) {
    throw std::invalid_argument(std::string(field) + " must be " + rule + " (got " +
                                std::to_string(value) + ")");
  }
}

}  // namespace

void CacheConfig::validate() const {
  require(block_tokens >= 1, "block_tokens", ">= 1", block_tokens);
  require(capacity_pages >= 1, "capacity_pages", ">= 1", capacity_pages);
  require(keep_tokens >= 1, "keep_tokens", ">= 1 (the last token must be computed)", keep_tokens);
  require(state_bytes >= 0, "state_bytes", ">= 0", state_bytes);
  std::int64_t sum = 0;
  for (std::size_t i = 0; i < state_parts.size(); ++i) {
    const std::string field = "state_parts[" + std::to_string(i) + "]";
    require(state_parts[i] >= 1, field.c_str(), ">= 1 bytes", state_parts[i]);
    require(state_parts[i] <= INT64_MAX - sum, field.c_str(), "such that the sum fits in 64 bits",
            state_parts[i]);
    sum += state_parts[i];
  }
  if (!state_parts.empty() && state_bytes != 0 && state_bytes != sum) {
    throw std::invalid_argument("state_bytes must be 0 or the sum of state_parts (" +
                                std::to_string(sum) + ") when state_parts is given (got " +
                                std::to_string(state_bytes) + ")");
  }
  const std::int64_t total = state_parts.empty() ? state_bytes : sum;
  if (total > 0) {
    require(capacity_states >= 1, "capacity_states", ">= 1 when a state is configured",
            capacity_states);
    require(state_lookback >= 1 && state_lookback <= 48, "state_lookback",
            "in [1, 48] when a state is configured", state_lookback);
  } else {
    require(capacity_states >= 0, "capacity_states", ">= 0", capacity_states);
  }
  require(key_bits >= 1 && key_bits <= 128, "key_bits", "in [1, 128]", key_bits);
  require(error_limit >= 1, "error_limit", ">= 1", error_limit);
  tier.validate();
  for (std::size_t i = 0; i < layer_segments.size(); ++i) {
    const std::string field = "layer_segments[" + std::to_string(i) + "]";
    require(layer_segments[i] >= 1, field.c_str(), ">= 1 segments", layer_segments[i]);
  }
  require(pool_chunk_bytes >= 1, "pool_chunk_bytes", ">= 1",
          static_cast<std::int64_t>(pool_chunk_bytes));
}

std::vector<std::int64_t> CacheConfig::state_part_bytes() const {
  if (!state_parts.empty()) return state_parts;
  if (state_bytes > 0) return {state_bytes};
  return {};
}

CacheConfig CacheConfig::normalized() const {
  validate();
  CacheConfig c = *this;
  if (!c.state_parts.empty()) {
    c.state_bytes = std::accumulate(c.state_parts.begin(), c.state_parts.end(), std::int64_t{0});
  }
  return c;
}

}  // namespace hicache
