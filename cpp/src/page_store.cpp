#include "hicache/page_store.hpp"

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string_view>

#include "disk_segment.hpp"
#include "hicache/hash_chain.hpp"
#include "hicache/tier_record.hpp"
#include "page_checksum.hpp"
#include "tier_wait.hpp"

namespace hicache {

PageStore::~PageStore() = default;

namespace {

// Values a tier batch carries at most, in bytes: a call's pages go in chunks of about this much,
// the next one gathered (or the last one checked) while the tier moves this one.
constexpr std::size_t kChunkBytes = std::size_t{32} << 20;

// Keys whose values failed their check that exists() reports missing, at most.
constexpr std::size_t kRejectedKept = 65536;

// Records of these values carry no tokens: the engine's key stands for them (SGLang's is a
// SHA-256 chain over the page's tokens and its parent's key).
constexpr std::span<const std::int32_t> kNoTokens{};

std::span<const std::uint8_t> bytes_of(std::string_view s) {
  return {reinterpret_cast<const std::uint8_t*>(s.data()), s.size()};
}

// An engine key as a record key. A domain prefix keeps these apart from hicache's own keys.
Key engine_key(std::string_view key) {
  std::string d = "hicache-page-store/key/";
  d += key;
  return chain_step({}, bytes_of(d));
}

// What a page's parent is recorded as: the engine's key before it, or, where the engine did not
// say, a marker no key maps to.
Key parent_key(const std::optional<std::string>& parent) {
  if (parent) return engine_key(*parent);
  const std::string_view unknown = "hicache-page-store/unknown-parent";
  return chain_step({}, bytes_of(unknown));
}

Key store_space(const PageStoreOptions& o) {
  std::string d = "hicache-page-store/space/";
  d += o.space;
  for (std::size_t b : o.piece_bytes) {
    d += '/';
    d += std::to_string(b);
  }
  return chain_step({}, bytes_of(d));
}

// Gathers a page's pieces into `out`, summing them on the way (one pass where every piece but
// the last is whole kilobytes, the checksum's blocks; else copied, then summed).
std::uint64_t gather(std::span<const std::uintptr_t> pieces, const std::vector<std::size_t>& sizes,
                     std::byte* out, std::size_t page_bytes) {
  detail::ChecksumCopy sum;
  std::byte* p = out;
  for (std::size_t j = 0; j < pieces.size(); ++j) {
    const std::span<const std::byte> piece{reinterpret_cast<const std::byte*>(pieces[j]), sizes[j]};
    if (!sum.add(piece, p)) {
      for (std::size_t k = j; k < pieces.size(); ++k) {
        std::memcpy(p, reinterpret_cast<const void*>(pieces[k]), sizes[k]);
        p += sizes[k];
      }
      return page_checksum({out, page_bytes});
    }
    p += sizes[j];
  }
  return sum.value();
}

// Scatters a checked record's page into the pieces, summing it on the way; true if the sum is
// the recorded one.
bool scatter(const TierPage& page, std::span<const std::uintptr_t> pieces,
             const std::vector<std::size_t>& sizes) {
  detail::ChecksumCopy sum;
  const std::byte* p = page.bytes.data();
  for (std::size_t j = 0; j < pieces.size(); ++j) {
    if (!sum.add({p, sizes[j]}, reinterpret_cast<std::byte*>(pieces[j]))) {
      if (page_checksum(page.bytes) != page.checksum) return false;
      for (std::size_t k = j; k < pieces.size(); ++k) {
        std::memcpy(reinterpret_cast<void*>(pieces[k]), p, sizes[k]);
        p += sizes[k];
      }
      return true;
    }
    p += sizes[j];
  }
  return sum.value() == page.checksum;
}

}  // namespace

void PageStoreOptions::validate() const {
  if (piece_bytes.empty()) throw std::invalid_argument("PageStoreOptions.piece_bytes is empty");
  for (std::size_t b : piece_bytes) {
    if (b == 0) throw std::invalid_argument("PageStoreOptions.piece_bytes holds a 0");
  }
  if (timeout.count() <= 0) throw std::invalid_argument("PageStoreOptions.timeout must be > 0");
}

PageStore::PageStore(std::shared_ptr<Tier> tier, PageStoreOptions options)
    : tier_(std::move(tier)),
      options_(std::move(options)),
      put_staging_(std::make_unique<Staging>()),
      get_staging_(std::make_unique<Staging>()) {
  if (!tier_) throw std::invalid_argument("PageStore: tier is null");
  options_.validate();
  for (std::size_t b : options_.piece_bytes) page_bytes_ += b;
  value_bytes_ = tier_value_bytes(0, page_bytes_);
  space_ = store_space(options_);
}

std::string PageStore::value_name(const std::string& key) const {
  return "hicache-pages/" + space_.hex() + "/" + key;
}

void PageStore::note_error(std::string what) {
  std::lock_guard<std::mutex> s(stats_mu_);
  stats_.last_error = std::move(what);
}

std::optional<std::vector<std::int64_t>> PageStore::finish(std::int64_t batch, std::size_t n) {
  if (batch < 0) {
    note_error(tier_->name() + " refused the batch (" + std::to_string(batch) + ")");
    return std::nullopt;
  }
  auto r = detail::wait_for_batch(*tier_, tier_mu_, batch,
                                  std::chrono::steady_clock::now() + options_.timeout);
  if (!r) {
    note_error(tier_->name() + " did not complete a batch in time");
  } else if (r->size() != n) {
    note_error(tier_->name() + " returned " + std::to_string(r->size()) + " results for " +
               std::to_string(n) + " values");
    r.reset();
  }
  return r;
}

// A batch of values in the tier, from or into one of the two staging buffers.
struct PageStore::Flight {
  std::int64_t batch = -1;
  std::size_t from = 0, count = 0;
  bool used = false;
};

struct PageStore::Staging {
  std::mutex mu;  // one put (or get) at a time uses the buffers
  detail::AlignedBuffer buf[2];
};

std::size_t PageStore::chunk_pages() const {
  return std::max<std::size_t>(1, kChunkBytes / value_bytes_);
}

void PageStore::check_pieces(const char* what, std::size_t keys, std::size_t pieces) const {
  if (pieces != keys * this->pieces()) {
    throw std::invalid_argument(std::string("PageStore.") + what + ": " + std::to_string(pieces) +
                                " piece addresses for " + std::to_string(keys) + " pages of " +
                                std::to_string(this->pieces()) + " pieces");
  }
}

std::vector<std::uint8_t> PageStore::put(std::span<const std::string> keys,
                                         const std::optional<std::string>& first_parent,
                                         std::span<const std::uintptr_t> pieces) {
  const std::size_t n = keys.size(), per = this->pieces();
  check_pieces("put", n, pieces.size());
  std::vector<std::uint8_t> ok(n, 0);
  if (n == 0) return ok;
  std::lock_guard<std::mutex> use(put_staging_->mu);
  std::int64_t done = 0, failed = 0, errors = 0;
  Flight flight[2];
  // A batch's values stay in its buffer until it completed: its results are taken before the
  // buffer is filled again, two chunks later.
  auto settle = [&](Flight& f) {
    if (!f.used) return;
    f.used = false;
    const auto r = finish(f.batch, f.count);
    for (std::size_t i = 0; i < f.count; ++i) {
      const bool good = r && (*r)[i] >= 0;
      ok[f.from + i] = good;
      good ? ++done : ++failed;
      if (!r || (*r)[i] == Tier::kFailed) ++errors;
    }
  };
  Key parent = parent_key(first_parent);
  const std::size_t chunk = chunk_pages();
  std::vector<std::string> names;
  std::vector<const std::byte*> values;
  for (std::size_t from = 0, c = 0; from < n; from += chunk, ++c) {
    Flight& f = flight[c % 2];
    settle(f);
    const std::size_t count = std::min(chunk, n - from);
    detail::AlignedBuffer& buf = put_staging_->buf[c % 2];
    buf.reserve(count * value_bytes_);
    names.assign(count, {});
    values.assign(count, nullptr);
    for (std::size_t i = 0; i < count; ++i) {
      std::byte* v = buf.data() + i * value_bytes_;
      const std::uint64_t sum =
          gather(pieces.subspan((from + i) * per, per), options_.piece_bytes, v, page_bytes_);
      const Key key = engine_key(keys[from + i]);
      write_tier_record(v + page_bytes_, space_, key, parent, kNoTokens, page_bytes_, sum);
      parent = key;
      names[i] = value_name(keys[from + i]);
      values[i] = v;
    }
    const std::vector<std::size_t> sizes(count, value_bytes_);
    {
      std::lock_guard<std::mutex> t(tier_mu_);
      f.batch = tier_->put(names, values, sizes);
    }
    f = Flight{f.batch, from, count, true};
  }
  const std::size_t last = (n - 1) / chunk;
  settle(flight[(last + 1) % 2]);  // the chunk before the last (if any), then the last
  settle(flight[last % 2]);
  std::lock_guard<std::mutex> s(stats_mu_);
  if (!rejected_.empty()) {
    for (std::size_t i = 0; i < n; ++i) {
      if (ok[i]) rejected_.erase(keys[i]);
    }
  }
  stats_.pages_put += done;
  stats_.pages_put_failed += failed;
  stats_.tier_errors += errors;
  return ok;
}

std::vector<std::uint8_t> PageStore::get(std::span<const std::string> keys,
                                         const std::optional<std::string>& first_parent,
                                         std::span<const std::uintptr_t> pieces) {
  const std::size_t n = keys.size(), per = this->pieces();
  check_pieces("get", n, pieces.size());
  std::vector<std::uint8_t> ok(n, 0);
  if (n == 0) return ok;
  std::lock_guard<std::mutex> use(get_staging_->mu);
  const std::size_t chunk = chunk_pages();
  const std::size_t chunks = (n + chunk - 1) / chunk;
  Flight flight[2];
  std::vector<std::string> names;
  std::vector<std::byte*> dests;
  // Chunk c is read into buffer c % 2 while chunk c - 1 is checked and scattered.
  auto submit = [&](std::size_t c) {
    const std::size_t from = c * chunk, count = std::min(chunk, n - from);
    detail::AlignedBuffer& buf = get_staging_->buf[c % 2];
    buf.reserve(count * value_bytes_);
    names.assign(count, {});
    dests.assign(count, nullptr);
    for (std::size_t i = 0; i < count; ++i) {
      names[i] = value_name(keys[from + i]);
      dests[i] = buf.data() + i * value_bytes_;
    }
    std::lock_guard<std::mutex> t(tier_mu_);
    flight[c % 2] = Flight{tier_->get(names, dests, value_bytes_), from, count, true};
  };
  std::int64_t got = 0, missing = 0, rejected = 0, errors = 0;
  std::string why, last_why;
  Key parent = parent_key(first_parent);
  submit(0);
  if (chunks > 1) submit(1);
  for (std::size_t c = 0; c < chunks; ++c) {
    Flight& f = flight[c % 2];
    f.used = false;
    const auto r = finish(f.batch, f.count);
    const std::byte* base = get_staging_->buf[c % 2].data();
    for (std::size_t i = 0; i < f.count; ++i) {
      const std::size_t k = f.from + i;
      const Key key = engine_key(keys[k]);
      if (!r || (*r)[i] == Tier::kFailed) {
        ++errors;
      } else if ((*r)[i] < 0) {
        ++missing;
      } else {
        const std::span<const std::byte> value{base + i * value_bytes_,
                                               static_cast<std::size_t>((*r)[i])};
        // An unknown first parent: the record's own parent stands in (a value too short for a
        // record fails the size check all the same).
        if (k == 0 && !first_parent && value.size() == value_bytes_) {
          parent = tier_record_parent(value, page_bytes_);
        }
        const TierPage page =
            check_tier_record(value, space_, key, parent, kNoTokens, page_bytes_, why);
        if (!page.bytes.empty() &&
            scatter(page, pieces.subspan(k * per, per), options_.piece_bytes)) {
          ok[k] = 1;
          ++got;
        } else {
          ++rejected;
          last_why = keys[k] + ": " +
                     (page.bytes.empty() ? why : "page bytes do not match their checksum");
          remember_rejected(keys[k]);
        }
      }
      parent = key;
    }
    if (c + 2 < chunks) submit(c + 2);
  }
  std::lock_guard<std::mutex> s(stats_mu_);
  stats_.pages_got += got;
  stats_.pages_missing += missing;
  stats_.pages_rejected += rejected;
  stats_.tier_errors += errors;
  if (!last_why.empty()) stats_.last_error = "rejected " + last_why;
  return ok;
}

std::vector<std::uint8_t> PageStore::exists(std::span<const std::string> keys) {
  std::vector<std::uint8_t> out(keys.size(), 0);
  if (keys.empty()) return out;
  std::vector<std::string> names(keys.size());
  for (std::size_t i = 0; i < keys.size(); ++i) names[i] = value_name(keys[i]);
  std::int64_t batch;
  {
    std::lock_guard<std::mutex> t(tier_mu_);
    batch = tier_->exists(names);
  }
  const auto r = finish(batch, keys.size());
  std::int64_t errors = r ? 0 : static_cast<std::int64_t>(keys.size());
  for (std::size_t i = 0; r && i < keys.size(); ++i) {
    out[i] = (*r)[i] == 1;
    if ((*r)[i] == Tier::kFailed) ++errors;
  }
  std::lock_guard<std::mutex> s(stats_mu_);
  stats_.tier_errors += errors;
  for (std::size_t i = 0; i < keys.size(); ++i) {
    if (out[i] && rejected_.contains(keys[i])) out[i] = 0;  // written again, it can serve
  }
  return out;
}

void PageStore::remember_rejected(const std::string& key) {
  std::lock_guard<std::mutex> s(stats_mu_);
  if (rejected_.size() >= kRejectedKept) rejected_.clear();  // forgotten: a miss until evicted
  rejected_.insert(key);
}

PageStoreStats PageStore::stats() const {
  std::lock_guard<std::mutex> s(stats_mu_);
  return stats_;
}

}  // namespace hicache
