#pragma once
// MemoryTier: a Tier in this process's memory, shared by every cache given the same object.
// Tests use it as the store several "hosts" share, with faults injected by hand; it is also the
// reference a backend's behaviour is compared with. Batches complete at once.

#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "hicache/tier.hpp"

namespace hicache {

class MemoryTier final : public Tier {
 public:
  std::string name() const override { return "memory"; }
  std::int64_t put(std::span<const std::string> names, std::span<const std::byte* const> values,
                   std::span<const std::size_t> sizes) override;
  std::int64_t get(std::span<const std::string> names, std::span<std::byte* const> dests,
                   std::size_t capacity) override;
  std::int64_t exists(std::span<const std::string> names) override;
  std::optional<std::vector<std::int64_t>> poll(std::int64_t batch) override;

  // Tests.
  std::size_t size() const;
  std::vector<std::string> names() const;
  /// Changes a stored value in place (truncate, overwrite); false if there is none.
  bool edit(const std::string& name, const std::function<void(std::vector<std::byte>&)>& fn);
  bool erase(const std::string& name);
  /// The next `n` batches fail as a lost connection does (every result kFailed).
  void fail_next(int n);
  std::int64_t batches() const;

 private:
  std::int64_t finish(std::vector<std::int64_t> results);
  mutable std::mutex mu_;
  std::unordered_map<std::string, std::vector<std::byte>> values_;
  std::map<std::int64_t, std::vector<std::int64_t>> done_;
  std::int64_t next_ = 1;
  int fail_ = 0;
};

}  // namespace hicache
