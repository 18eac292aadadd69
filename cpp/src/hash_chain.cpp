#include "hicache/hash_chain.hpp"

#include <algorithm>
#include <atomic>
#include <bit>
#include <cstring>
#include <stdexcept>

#include "blake2b.hpp"
#include "chain_hasher.hpp"
#include "page_threads.hpp"

namespace hicache {

std::string Key::hex() const {
  static const char* digits = "0123456789abcdef";
  std::string s(32, '0');
  for (std::size_t i = 0; i < bytes.size(); ++i) {
    s[2 * i] = digits[bytes[i] >> 4];
    s[2 * i + 1] = digits[bytes[i] & 15];
  }
  return s;
}

namespace {

// Token bytes a hashing thread takes at least (~100 us of hashing: a thread costs tens of
// microseconds to start); runs shorter than two threads' worth stay on the calling thread.
constexpr std::size_t kHashBytesPerThread = std::size_t{64} << 10;

void absorb(detail::Blake2b& h, std::span<const std::int32_t> tokens) {
  if constexpr (std::endian::native == std::endian::little) {
    h.update(tokens.data(), tokens.size_bytes());
  } else {
    for (std::int32_t t : tokens) {
      const auto u = static_cast<std::uint32_t>(t);
      const std::uint8_t le[4] = {static_cast<std::uint8_t>(u), static_cast<std::uint8_t>(u >> 8),
                                  static_cast<std::uint8_t>(u >> 16),
                                  static_cast<std::uint8_t>(u >> 24)};
      h.update(le, 4);
    }
  }
}

Key finish(detail::Blake2b& h, std::span<const std::uint8_t> suffix) {
  h.update(suffix.data(), suffix.size());
  Key k;
  h.finish(k.bytes.data());
  return k;
}

}  // namespace

Key chain_step(std::span<const std::int32_t> tokens, std::span<const std::uint8_t> suffix) {
  detail::Blake2b h(16);
  absorb(h, tokens);
  return finish(h, suffix);
}

namespace {

void truncate_key(Key& k, int key_bits) {
  for (int byte = 0; byte < 16; ++byte) {
    const int keep = std::clamp(key_bits - 8 * byte, 0, 8);
    k.bytes[static_cast<std::size_t>(byte)] &= static_cast<std::uint8_t>(0xFF00 >> keep);
  }
}

}  // namespace

std::vector<Key> chain_keys(std::string_view salt, std::span<const std::int32_t> tokens,
                            std::int64_t block_tokens, std::int64_t max_pages, int key_bits) {
  std::vector<Key> keys;
  extend_chain_keys(keys, salt, tokens, block_tokens, max_pages, key_bits);
  return keys;
}

void extend_chain_keys(std::vector<Key>& keys, std::string_view salt,
                       std::span<const std::int32_t> tokens, std::int64_t block_tokens,
                       std::int64_t max_pages, int key_bits) {
  detail::ChainHasher(salt, tokens, block_tokens, max_pages, key_bits).extend(keys, max_pages);
}

namespace detail {

ChainHasher::ChainHasher(std::string_view salt, std::span<const std::int32_t> tokens,
                         std::int64_t block_tokens, std::int64_t limit, int key_bits)
    : salt_(reinterpret_cast<const std::uint8_t*>(salt.data()), salt.size()),
      tokens_(tokens),
      block_tokens_(static_cast<std::size_t>(block_tokens)),
      key_bits_(key_bits) {
  if (block_tokens < 1) throw std::invalid_argument("block_tokens must be >= 1");
  if (key_bits < 1 || key_bits > 128) throw std::invalid_argument("key_bits must be in [1, 128]");
  const auto full = static_cast<std::int64_t>(tokens.size()) / block_tokens;
  limit_ = static_cast<std::size_t>(std::max<std::int64_t>(0, std::min(full, limit)));
}

std::span<const std::int32_t> ChainHasher::page(std::size_t i) const {
  return tokens_.subspan(i * block_tokens_, block_tokens_);
}

// The token blocks of pages [first, end) (at most kMaxMidstates of them), on the page threads if
// they are many bytes: each page's state after every block but a last one that a key or salt
// follows. Four pages at a time (Blake2b::update4); the first page of an unsalted chain alone,
// as its last token block ends its message (nothing follows it).
void ChainHasher::hash_blocks_ahead(std::size_t first, std::size_t end) {
  mids_first_ = first;
  mids_.assign(std::min(end - first, kMaxMidstates), Blake2b(16));
  const std::size_t bytes = block_tokens_ * sizeof(std::int32_t);
  const auto one = [&](std::size_t j) {
    const std::size_t i = first + j;
    absorb(mids_[j], page(i));
    if (i > 0 || !salt_.empty()) mids_[j].more_follows();
  };
  // Pages j .. j + n - 1 (n <= 4) side by side. A group of two or three fills the other lanes
  // with spare states that hash a copy of its first page again; one page goes alone (quicker).
  const auto group = [&](std::size_t j, std::size_t n) {
    if (std::endian::native != std::endian::little || n == 1) {
      for (std::size_t k = j; k < j + n; ++k) one(k);
      return;
    }
    Blake2b spare[3] = {Blake2b(16), Blake2b(16), Blake2b(16)};
    Blake2b* states[4];
    const std::uint8_t* data[4];
    for (std::size_t l = 0; l < 4; ++l) {
      states[l] = l < n ? &mids_[j + l] : &spare[l - 1];
      data[l] = reinterpret_cast<const std::uint8_t*>(page(first + j + (l < n ? l : 0)).data());
    }
    Blake2b::update4(states, data, bytes);
  };
  const std::size_t lead = first == 0 && salt_.empty() ? std::min<std::size_t>(1, mids_.size()) : 0;
  for (std::size_t j = 0; j < lead; ++j) one(j);
  const std::size_t groups = (mids_.size() - lead + 3) / 4;
  for_each_page(
      groups, 4 * bytes,
      [&](std::size_t g) {
        const std::size_t j = lead + 4 * g;
        group(j, std::min<std::size_t>(4, mids_.size() - j));
      },
      kHashBytesPerThread);
}

namespace {
std::atomic<std::uint64_t> keys_hashed_total{0};
}  // namespace

std::uint64_t ChainHasher::keys_hashed() {
  return keys_hashed_total.load(std::memory_order_relaxed);
}

void ChainHasher::extend(std::vector<Key>& keys, std::int64_t upto,
                         std::atomic<std::size_t>* published) {
  const std::size_t n = std::min(limit_, static_cast<std::size_t>(std::max<std::int64_t>(0, upto)));
  if (n > keys.size()) keys_hashed_total.fetch_add(n - keys.size(), std::memory_order_relaxed);
  keys.reserve(n);
  // Published every key (a release store costs a plain store here), waiters woken every
  // kWakeEvery keys and at the end (a wake is a system call where one waits).
  constexpr std::size_t kWakeEvery = 16;
  const auto publish = [&] {
    if (published == nullptr) return;
    published->store(keys.size(), std::memory_order_release);
    if (keys.size() % kWakeEvery == 0 || keys.size() == n) published->notify_all();
  };
  while (keys.size() < n) {
    const std::size_t i = keys.size();
    const bool ahead = i >= mids_first_ && i < mids_first_ + mids_.size();
    // Each installment's pages are hashed ahead as it asks for them (hashing every later page
    // ahead at once kept a store's first copies waiting behind it: BENCHMARKS.md), four at a
    // time where there are four.
    if (!ahead && n - i >= 4) {
      hash_blocks_ahead(i, n);
      continue;
    }
    Blake2b h(16);
    if (ahead) {
      h = mids_[i - mids_first_];
    } else {
      absorb(h, page(i));
    }
    keys.push_back(finish(h, i == 0 ? salt_ : std::span<const std::uint8_t>(keys.back().bytes)));
    if (key_bits_ < 128) truncate_key(keys.back(), key_bits_);
    publish();
  }
}

ChainAhead::ChainAhead(ChainHasher& hasher, const std::vector<Key>& keys) : hasher_(hasher) {
  if (hasher.limit() < keys.size() + kLeast) return;
  ahead_.reserve(hasher.limit());
  ahead_.assign(keys.begin(), keys.end());
  keys_ = ahead_.data();
  published_.store(ahead_.size(), std::memory_order_relaxed);
  running_ = task_.start([this] {
    try {
      // In doubling installments, as the store's own: each one's token blocks are hashed ahead
      // (on the page threads) before its keys, so the first keys come before the last pages'
      // blocks are hashed.
      constexpr std::size_t kLeastInstallment = 16;
      for (std::size_t upto = ahead_.size(); upto < hasher_.limit();) {
        upto = std::min(hasher_.limit(), std::max(2 * upto, upto + kLeastInstallment));
        hasher_.extend(ahead_, static_cast<std::int64_t>(upto), &published_);
      }
    } catch (...) {  // (an allocation): wake the caller, whose wait() rethrows it
      published_.store(kFailed, std::memory_order_release);
      published_.notify_all();
      throw;
    }
  });
  started_ = running_;
}

void ChainAhead::extend(std::vector<Key>& keys, std::int64_t least, std::int64_t upto) {
  if (!running_) return hasher_.extend(keys, upto);
  const std::size_t n =
      std::min(hasher_.limit(), static_cast<std::size_t>(std::max<std::int64_t>(0, least)));
  std::size_t ready = published_.load(std::memory_order_acquire);
  while (ready < n) {
    published_.wait(ready, std::memory_order_acquire);
    ready = published_.load(std::memory_order_acquire);
  }
  // The whole chain published (the background is done with it, or about to be) or a failure:
  // the task is waited for, and a failure rethrown, before any key is taken.
  if (ready == kFailed || ready == hasher_.limit()) {
    running_ = false;
    task_.wait();
  }
  if (ready > keys.size()) keys.insert(keys.end(), keys_ + keys.size(), keys_ + ready);
}

}  // namespace detail
}  // namespace hicache
