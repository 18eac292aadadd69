#include "hicache/admission_policy.hpp"

#include <algorithm>
#include <climits>
#include <cstring>
#include <stdexcept>
#include <string>

#include "flat_lru.hpp"

namespace hicache {

std::string_view admission_name(Admission a) {
  switch (a) {
    case Admission::kAlways:
      return "always";
    case Admission::kSecondSighting:
      return "second-sighting";
    case Admission::kAdaptive:
      return "adaptive";
  }
  return "?";
}

Admission parse_admission(std::string_view name) {
  for (Admission a : {Admission::kAlways, Admission::kSecondSighting, Admission::kAdaptive}) {
    if (name == admission_name(a)) return a;
  }
  throw std::invalid_argument("admission must be 'adaptive', 'second-sighting' or 'always', not '" +
                              std::string(name) + "'");
}

std::uint64_t key_fingerprint(const Key& k) {
  std::uint64_t fp;
  std::memcpy(&fp, k.bytes.data(), sizeof fp);
  return fp;
}

namespace {

std::uint64_t stored(std::uint64_t fp) { return fp == 0 ? 1 : fp; }

std::size_t home(std::uint64_t fp, std::size_t mask) {
  return (fp * 0x9e3779b97f4a7c15ULL) >> 20 & mask;
}

}  // namespace

// Tables start small and double while at most half full: a ghost sized for a huge pool costs
// nothing until keys arrive (an idle cache of any capacity allocates nothing).
GhostKeys::GhostKeys(std::size_t generation) : generation_(std::max<std::size_t>(1, generation)) {
  newer_.slots.assign(16, 0);
  older_.slots.assign(16, 0);
}

bool GhostKeys::Table::contains(std::uint64_t fp) const {
  fp = stored(fp);
  const std::size_t mask = slots.size() - 1;
  for (std::size_t i = home(fp, mask);; i = (i + 1) & mask) {
    if (slots[i] == fp) return true;
    if (slots[i] == 0) return false;
  }
}

bool GhostKeys::Table::insert(std::uint64_t fp) {
  fp = stored(fp);
  if (2 * (size + 1) > slots.size()) {
    std::vector<std::uint64_t> old(slots.size() * 2, 0);
    old.swap(slots);
    const std::size_t mask = slots.size() - 1;
    for (std::uint64_t v : old) {
      if (v == 0) continue;
      std::size_t i = home(v, mask);
      while (slots[i] != 0) i = (i + 1) & mask;
      slots[i] = v;
    }
  }
  const std::size_t mask = slots.size() - 1;
  for (std::size_t i = home(fp, mask);; i = (i + 1) & mask) {
    if (slots[i] == fp) return false;
    if (slots[i] == 0) {
      slots[i] = fp;
      ++size;
      return true;
    }
  }
}

void GhostKeys::Table::prefetch(std::uint64_t fp) const {
  __builtin_prefetch(&slots[home(stored(fp), slots.size() - 1)]);
}

void GhostKeys::prefetch(std::uint64_t fp) const {
  newer_.prefetch(fp);
  older_.prefetch(fp);
}

void GhostKeys::Table::clear() {
  std::fill(slots.begin(), slots.end(), 0);
  size = 0;
}

bool GhostKeys::check_and_record(std::uint64_t fp) {
  if (!newer_.insert(fp)) return true;
  const bool seen = older_.contains(fp);
  if (newer_.size >= generation_) {
    std::swap(older_, newer_);
    newer_.clear();
  }
  return seen;
}

void GhostKeys::record(std::uint64_t fp) {
  if (!newer_.insert(fp)) return;
  if (newer_.size >= generation_) {
    std::swap(older_, newer_);
    newer_.clear();
  }
}

namespace {

// Ghost generations of four pools' worth of keys: a key is remembered for 4-8 pools' worth of
// later keys. Generations of 2, 3 and 4 pools measured on the Mooncake traces (BENCHMARKS.md):
// 4 was best overall (conversation 0.442 / 0.522 of the optimum at 1M / 3M tokens, synthetic
// 0.418 / 0.619; with 2: 0.440 / 0.516 and 0.382 / 0.612).
std::size_t ghost_generation(std::int64_t capacity) {
  return static_cast<std::size_t>(std::clamp<std::int64_t>(capacity, 1, INT64_MAX / 4) * 4);
}

class AlwaysAdmit final : public AdmissionPolicy {
 public:
  void observe_more(std::span<const Key>) override {}
  bool admit(std::size_t, bool) override { return true; }
  bool wants_second_sighting() const override { return false; }
};

// Remembers which keys of the prompt were in the ghost before this prompt recorded them.
class Sightings {
  static constexpr std::size_t kAhead = 8;  // keys prefetched ahead of the probe

 public:
  explicit Sightings(std::int64_t capacity) : ghost_(ghost_generation(capacity)) {}
  /// A store begins: seen_before() forgets the previous store's keys.
  void begin() { seen_.clear(); }
  // Key by key: whether it was in the ghost, then recorded (a key repeated within one prompt,
  // possible only with the tests' truncated keys, is seen at its second place). Appends to the
  // store's keys so far.
  void observe(std::span<const Key> keys) {
    const std::size_t first = seen_.size();
    seen_.resize(first + keys.size(), false);
    for (std::size_t i = 0; i < keys.size(); ++i) {
      if (i + kAhead < keys.size()) ghost_.prefetch(key_fingerprint(keys[i + kAhead]));
      seen_[first + i] = ghost_.check_and_record(key_fingerprint(keys[i]));
    }
  }
  /// Records the keys without answering seen_before (which then says false for them).
  void record(std::span<const Key> keys) {
    seen_.resize(seen_.size() + keys.size(), false);
    for (std::size_t i = 0; i < keys.size(); ++i) {
      if (i + kAhead < keys.size()) ghost_.prefetch(key_fingerprint(keys[i + kAhead]));
      ghost_.record(key_fingerprint(keys[i]));
    }
  }
  bool seen_before(std::size_t i) const { return i < seen_.size() && seen_[i]; }

 private:
  GhostKeys ghost_;
  std::vector<bool> seen_;
};

class SecondSighting final : public AdmissionPolicy {
 public:
  explicit SecondSighting(std::int64_t capacity) : sightings_(capacity) {}
  void observe_more(std::span<const Key> keys) override { sightings_.observe(keys); }
  bool admit(std::size_t i, bool pool_full) override {
    return !pool_full || sightings_.seen_before(i);
  }
  bool wants_second_sighting() const override { return true; }

 private:
  void begin() override { sightings_.begin(); }
  Sightings sightings_;
};

// A page-level LRU over sampled keys: counts the hits a pool of `capacity` slots would get with
// write-through (ghost_generation 0) or with second-sighting admission. Pages here are
// independent (no chains): an estimate, good enough to rank the two.
class MiniLru {
 public:
  MiniLru(std::size_t capacity, std::size_t ghost_generation)
      : second_sighting_(ghost_generation != 0),
        ghost_(second_sighting_ ? ghost_generation : 1),
        lru_(std::max<std::size_t>(1, capacity)) {}

  void access(std::uint64_t fp) {
    if (lru_.touch(fp)) {
      hits_ += 1.0;
      return;
    }
    if (lru_.full() && second_sighting_ && !ghost_.contains(fp)) {
      ghost_.record(fp);
      return;
    }
    lru_.add(fp);
  }
  void decay(double f) { hits_ *= f; }
  double hits() const { return hits_; }

 private:
  bool second_sighting_;
  GhostKeys ghost_;
  detail::FlatLru lru_;
  double hits_ = 0.0;
};

class Adaptive final : public AdmissionPolicy {
 public:
  // One key in `sample_` is simulated; each simulated pool has capacity / sample_ slots, at
  // least 256 where the capacity allows (fewer make the estimate noisy).
  explicit Adaptive(std::int64_t capacity)
      : sightings_(capacity),
        sample_(static_cast<std::uint64_t>(std::clamp<std::int64_t>(capacity / 256, 1, 32))),
        write_through_(static_cast<std::size_t>(capacity) / sample_, std::size_t{0}),
        second_(static_cast<std::size_t>(capacity) / sample_,
                ghost_generation(capacity / static_cast<std::int64_t>(sample_))) {}

  void observe_more(std::span<const Key> keys) override {
    for (const Key& k : keys) {
      const std::uint64_t fp = key_fingerprint(k);
      if ((fp >> 32) % sample_ != 0) continue;
      write_through_.access(fp);
      second_.access(fp);
    }
    // Writing through, this store needs no sightings, and recording the keys costs one probe a
    // key, not two.
    if (second_sighting_) {
      sightings_.observe(keys);
    } else {
      sightings_.record(keys);
    }
  }
  bool admit(std::size_t i, bool pool_full) override {
    return !pool_full || !second_sighting_ || sightings_.seen_before(i);
  }
  bool wants_second_sighting() const override { return second_sighting_; }

 private:
  void begin() override {
    // Hits of the last ~1000 stores count most (half-life 693 stores): the choice follows the
    // workload as it changes. It is made as the store begins, from the stores before it (their
    // keys went through the simulations), so the store's first installment can be admitted
    // before the rest of its prompt is hashed.
    write_through_.decay(kDecay);
    second_.decay(kDecay);
    second_sighting_ = second_.hits() > write_through_.hits();
    sightings_.begin();
  }
  static constexpr double kDecay = 0.999;
  Sightings sightings_;
  std::uint64_t sample_;
  MiniLru write_through_;
  MiniLru second_;
  bool second_sighting_ = false;
};

}  // namespace

std::unique_ptr<AdmissionPolicy> make_admission_policy(Admission kind,
                                                       std::int64_t capacity_pages) {
  switch (kind) {
    case Admission::kAlways:
      return std::make_unique<AlwaysAdmit>();
    case Admission::kSecondSighting:
      return std::make_unique<SecondSighting>(capacity_pages);
    case Admission::kAdaptive:
      return std::make_unique<Adaptive>(capacity_pages);
  }
  throw std::invalid_argument("unknown admission policy");
}

}  // namespace hicache
