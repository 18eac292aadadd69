#include "hicache/memory_tier.hpp"

#include <cstring>
#include <stdexcept>

namespace hicache {

void TierOptions::validate() const {
  if (wait_us < 0) throw std::invalid_argument("tier wait_us must be >= 0");
  if (queue_pages < 0) throw std::invalid_argument("tier queue_pages must be >= 0");
  if (buffer_bytes < 1) throw std::invalid_argument("tier buffer_bytes must be >= 1");
  if (space.empty()) throw std::invalid_argument("tier space must not be empty");
}

std::int64_t MemoryTier::finish(std::vector<std::int64_t> results) {
  if (fail_ > 0) {
    --fail_;
    for (auto& r : results) r = kFailed;
  }
  const std::int64_t id = next_++;
  done_.emplace(id, std::move(results));
  return id;
}

std::int64_t MemoryTier::put(std::span<const std::string> names,
                             std::span<const std::byte* const> values,
                             std::span<const std::size_t> sizes) {
  std::lock_guard<std::mutex> g(mu_);
  std::vector<std::int64_t> r(names.size(), kFailed);
  if (fail_ == 0) {
    for (std::size_t i = 0; i < names.size(); ++i) {
      values_[names[i]].assign(values[i], values[i] + sizes[i]);
      r[i] = static_cast<std::int64_t>(sizes[i]);
    }
  }
  return finish(std::move(r));
}

std::int64_t MemoryTier::get(std::span<const std::string> names, std::span<std::byte* const> dests,
                             std::size_t capacity) {
  std::lock_guard<std::mutex> g(mu_);
  std::vector<std::int64_t> r(names.size(), kMissing);
  for (std::size_t i = 0; i < names.size(); ++i) {
    auto it = values_.find(names[i]);
    if (it == values_.end()) continue;
    if (it->second.size() > capacity) {
      r[i] = kFailed;
      continue;
    }
    std::memcpy(dests[i], it->second.data(), it->second.size());
    r[i] = static_cast<std::int64_t>(it->second.size());
  }
  return finish(std::move(r));
}

std::int64_t MemoryTier::exists(std::span<const std::string> names) {
  std::lock_guard<std::mutex> g(mu_);
  std::vector<std::int64_t> r(names.size());
  for (std::size_t i = 0; i < names.size(); ++i) r[i] = values_.count(names[i]) ? 1 : 0;
  return finish(std::move(r));
}

std::optional<std::vector<std::int64_t>> MemoryTier::poll(std::int64_t batch) {
  std::lock_guard<std::mutex> g(mu_);
  auto it = done_.find(batch);
  if (it == done_.end()) throw std::invalid_argument("MemoryTier: unknown batch");
  auto r = std::move(it->second);
  done_.erase(it);
  return r;
}

std::size_t MemoryTier::size() const {
  std::lock_guard<std::mutex> g(mu_);
  return values_.size();
}

std::vector<std::string> MemoryTier::names() const {
  std::lock_guard<std::mutex> g(mu_);
  std::vector<std::string> out;
  for (const auto& [k, v] : values_) out.push_back(k);
  return out;
}

bool MemoryTier::edit(const std::string& name,
                      const std::function<void(std::vector<std::byte>&)>& fn) {
  std::lock_guard<std::mutex> g(mu_);
  auto it = values_.find(name);
  if (it == values_.end()) return false;
  fn(it->second);
  return true;
}

bool MemoryTier::erase(const std::string& name) {
  std::lock_guard<std::mutex> g(mu_);
  return values_.erase(name) != 0;
}

void MemoryTier::fail_next(int n) {
  std::lock_guard<std::mutex> g(mu_);
  fail_ = n;
}

std::int64_t MemoryTier::batches() const {
  std::lock_guard<std::mutex> g(mu_);
  return next_ - 1;
}

}  // namespace hicache
