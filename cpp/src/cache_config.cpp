#include "hicache/cache_config.hpp"

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
  if (state_bytes > 0) {
    require(capacity_states >= 1, "capacity_states", ">= 1 when state_bytes > 0", capacity_states);
    require(state_lookback >= 1, "state_lookback", ">= 1 when state_bytes > 0", state_lookback);
  } else {
    require(capacity_states >= 0, "capacity_states", ">= 0", capacity_states);
  }
  require(key_bits >= 1 && key_bits <= 128, "key_bits", "in [1, 128]", key_bits);
  require(error_limit >= 1, "error_limit", ">= 1", error_limit);
  require(pool_chunk_bytes >= 1, "pool_chunk_bytes", ">= 1",
          static_cast<std::int64_t>(pool_chunk_bytes));
}

}  // namespace hicache
