#pragma once
// A fixed-capacity LRU of 64-bit fingerprints in flat arrays (internal): the adaptive admission
// policy's simulated pools (admission_policy.cpp).
//
// Why: those pools were a std::list and a std::unordered_map, which allocated two nodes for each
// key they took in and freed two for each they dropped. Under perf (stores of 1024 new 16-token
// pages into a cold pool of 65536, hicache_bench_store_walk, this project's 2-core machine) the
// policy's observe_more and that map were 6.9 % of the samples, 1.0-1.4 % with this. Here nodes are
// array slots linked by index, and the table is open-addressed with backward-shift deletion
// (linear_probing.hpp), grown with the keys held: once full, nothing is allocated.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "hicache/linear_probing.hpp"

namespace hicache::detail {

class FlatLru {
 public:
  static constexpr std::uint32_t kNone = UINT32_MAX;

  /// @param capacity at least 1 (and below 2^32). Memory grows with the keys held, not with the
  ///        capacity: a cache of a huge capacity costs nothing until used.
  explicit FlatLru(std::size_t capacity)
      : capacity_(std::clamp<std::size_t>(capacity, 1, kNone - 1)), table_(16, 0) {}

  std::size_t size() const { return size_; }
  bool full() const { return size_ == capacity_; }

  /// Whether fp is held; if so it becomes the most recently used.
  bool touch(std::uint64_t fp) {
    const std::size_t i = find_slot(fp);
    if (table_[i] == 0) return false;
    const std::uint32_t n = table_[i] - 1;
    unlink(n);
    link_front(n);
    return true;
  }

  /// Adds fp (not held) as the most recently used, dropping the least recently used if full.
  void add(std::uint64_t fp) {
    std::uint32_t n = 0;
    if (full()) {
      n = tail_;
      erase_and_shift_back(
          table_, find_slot(fp_[n]), [](std::uint32_t s) { return s == 0; },
          [&](std::uint32_t s) { return fibonacci_home(fp_[s - 1], shift_); });
      unlink(n);
    } else {
      if (2 * (size_ + 1) > table_.size()) grow();
      n = static_cast<std::uint32_t>(size_++);
      fp_.push_back(fp);
      prev_.push_back(kNone);
      next_.push_back(kNone);
    }
    fp_[n] = fp;
    table_[find_slot(fp)] = n + 1;
    link_front(n);
  }

  /// Fingerprints held, most recently used first (tests).
  std::vector<std::uint64_t> order() const {
    std::vector<std::uint64_t> out;
    for (std::uint32_t n = head_; n != kNone; n = next_[n]) out.push_back(fp_[n]);
    return out;
  }

 private:
  // fp's slot, or the empty slot where its probe ends.
  std::size_t find_slot(std::uint64_t fp) const {
    const std::size_t mask = table_.size() - 1;
    for (std::size_t i = fibonacci_home(fp, shift_);; i = (i + 1) & mask) {
      if (table_[i] == 0 || fp_[table_[i] - 1] == fp) return i;
    }
  }
  // Twice the slots, every key placed again (at most half the slots are ever taken).
  void grow() {
    table_.assign(2 * table_.size(), 0);
    --shift_;
    for (std::size_t n = 0; n < size_; ++n) {
      table_[find_slot(fp_[n])] = static_cast<std::uint32_t>(n + 1);
    }
  }
  void unlink(std::uint32_t n) {
    (prev_[n] == kNone ? head_ : next_[prev_[n]]) = next_[n];
    (next_[n] == kNone ? tail_ : prev_[next_[n]]) = prev_[n];
  }
  void link_front(std::uint32_t n) {
    prev_[n] = kNone;
    next_[n] = head_;
    (head_ == kNone ? tail_ : prev_[head_]) = n;
    head_ = n;
  }

  std::size_t capacity_;
  std::vector<std::uint64_t> fp_;
  std::vector<std::uint32_t> prev_, next_;
  std::vector<std::uint32_t> table_;  // node + 1; 0: empty
  int shift_ = 60;                    // 16 slots
  std::size_t size_ = 0;
  std::uint32_t head_ = kNone, tail_ = kNone;
};

}  // namespace hicache::detail
