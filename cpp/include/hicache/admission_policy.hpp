#pragma once
// Which new pages are worth a host slot.
//
// Write-through stores every full block of every prompt. In a small pool most of those pages are
// never read again (on the Mooncake conversation trace 72 % of pages are seen once) and each one
// evicts a page that would have been. An AdmissionPolicy sees the page keys of every prompt
// store() is given and decides, page by page, whether a page that is not cached may take a slot.
// A declined page ends the store there: its descendants cannot be cached without it.
//
// Policies (measured with `hicache replay`, see BENCHMARKS.md):
//   kAlways          write-through: every page is admitted.
//   kSecondSighting  while the pool is full, a page is admitted only if its key was seen in a
//                    recent prompt (a "ghost" of keys without data: the last 4-8 pools' worth).
//   kAdaptive        admits every page, or only second sightings, whichever the two miniature
//                    simulations it runs beside the cache (page-level LRUs over a 1/R sample of
//                    keys, capacity / R slots) found better over the recent past, chosen as a
//                    store begins (from the stores before it, so that a store can admit its
//                    first pages before it has hashed the rest). Small pools under pressure get
//                    second sightings, large ones write-through.
//
// Not thread-safe: the cache calls it under its lock.

#include <cstdint>
#include <memory>
#include <span>
#include <string_view>
#include <vector>

#include "hicache/key.hpp"

namespace hicache {

enum class Admission { kAlways, kSecondSighting, kAdaptive };

/// "always", "second-sighting", "adaptive".
std::string_view admission_name(Admission a);
/// @throws std::invalid_argument naming the accepted values.
Admission parse_admission(std::string_view name);

class AdmissionPolicy {
 public:
  virtual ~AdmissionPolicy() = default;
  /// A store begins: the chain keys of its prompt's first full pages, in order (all of them, or
  /// a first installment that observe_more() continues); called once per store before any
  /// admit() for them.
  void observe(std::span<const Key> keys) {
    begin();
    observe_more(keys);
  }
  /// The store's next keys, in order after those it observed so far; before any admit() for
  /// them. (HostPrefixCache::store hashes, admits and copies a long prompt in installments.)
  virtual void observe_more(std::span<const Key> keys) = 0;
  /// Whether page `i` of the store's keys (counted from the first observe()d), which is not
  /// cached, may take a slot. `pool_full`: taking one evicts a cached page.
  virtual bool admit(std::size_t i, bool pool_full) = 0;
  /// Whether first sightings are declined now (always false for kAlways; for kAdaptive, the
  /// simulations' current choice).
  virtual bool wants_second_sighting() const = 0;

 protected:
  /// A store begins (observe() then passes its first keys to observe_more()).
  virtual void begin() {}
};

/// @param capacity_pages the pool's slots: sizes the ghost and the simulations.
std::unique_ptr<AdmissionPolicy> make_admission_policy(Admission kind, std::int64_t capacity_pages);

/// Keys seen recently, without data: two generations of 64-bit fingerprints in flat
/// open-addressed tables, each holding up to `generation` keys; when the newer one fills, the
/// older is dropped. A key is remembered for between `generation` and 2 x `generation` distinct
/// keys recorded after it. A fingerprint collision only admits a page early; it never serves one.
class GhostKeys {
 public:
  explicit GhostKeys(std::size_t generation);
  bool contains(std::uint64_t fp) const { return newer_.contains(fp) || older_.contains(fp); }
  void record(std::uint64_t fp);
  /// Whether fp was remembered, then records it: contains() and record() in two probes, not
  /// three (the ghost sees every page of every prompt).
  bool check_and_record(std::uint64_t fp);
  /// Hints the CPU to fetch where fp's probes start (a large ghost misses the caches).
  void prefetch(std::uint64_t fp) const;
  std::size_t size() const { return newer_.size + older_.size; }

 private:
  struct Table {
    std::vector<std::uint64_t> slots;  // 0: empty (fingerprint 0 is stored as 1)
    std::size_t size = 0;
    bool contains(std::uint64_t fp) const;
    bool insert(std::uint64_t fp);  // false if present
    void prefetch(std::uint64_t fp) const;
    void clear();
  };
  std::size_t generation_;
  Table newer_;
  Table older_;
};

/// The fingerprint the ghost and the simulations use (the key's first eight bytes).
std::uint64_t key_fingerprint(const Key& k);

}  // namespace hicache
