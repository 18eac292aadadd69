#include "hicache/block_catalog.hpp"

#include <stdexcept>
#include <string>

#include "hicache/chain_walk.hpp"

namespace hicache {
namespace {

constexpr std::uint64_t kRoot = 1;

std::string nth(std::size_t i) { return "key " + std::to_string(i); }

}  // namespace

void CatalogOptions::validate() const {
  if (capacity_slots < 1) {
    throw std::invalid_argument("capacity_slots must be >= 1 (got " +
                                std::to_string(capacity_slots) + ")");
  }
}

BlockCatalog::BlockCatalog(CatalogOptions options)
    : index_((options.validate(), options.capacity_slots), options.eviction),
      admission_(make_admission_policy(options.admission, options.capacity_slots)) {}

BlockCatalog::Lookup BlockCatalog::lookup(const Key& key) {
  std::lock_guard<std::mutex> g(mu_);
  ++stats_.lookups;
  const Entry* e = index_.find(key);
  if (e == nullptr) return Lookup::kMiss;
  if (!e->ready) return Lookup::kPending;
  ++stats_.lookup_hits;
  return Lookup::kHit;
}

std::vector<std::int64_t> BlockCatalog::prepare_load(std::span<const Key> keys) {
  std::lock_guard<std::mutex> g(mu_);
  std::vector<Entry*> entries;
  entries.reserve(keys.size());
  for (std::size_t i = 0; i < keys.size(); ++i) {
    Entry* e = index_.find(keys[i]);
    if (e == nullptr || !e->ready) {
      throw std::invalid_argument("prepare_load: " + nth(i) + " (" + keys[i].hex() + ") is " +
                                  (e == nullptr ? "not cached" : "still being stored"));
    }
    entries.push_back(e);
  }
  std::vector<std::int64_t> slots;
  slots.reserve(entries.size());
  for (Entry* e : entries) {
    index_.pin(e);
    slots.push_back(e->slot);
  }
  stats_.blocks_loaded += static_cast<std::int64_t>(entries.size());
  return slots;
}

void BlockCatalog::complete_load(std::span<const Key> keys) {
  std::lock_guard<std::mutex> g(mu_);
  for (std::size_t i = 0; i < keys.size(); ++i) {
    Entry* e = index_.find(keys[i]);
    if (e == nullptr || !e->ready || e->refs == 0) {
      throw std::invalid_argument("complete_load: " + nth(i) + " (" + keys[i].hex() +
                                  ") is not being loaded");
    }
  }
  for (const Key& k : keys) index_.unpin(index_.find(k));
}

void BlockCatalog::touch(std::span<const Key> keys) {
  std::lock_guard<std::mutex> g(mu_);
  std::vector<Entry*> chain;
  for (const Key& k : keys) {
    if (Entry* e = index_.find(k); e != nullptr && e->ready) chain.push_back(e);
  }
  index_.touch_chain(chain);
}

BlockCatalog::StorePlan BlockCatalog::prepare_store(std::span<const Key> keys,
                                                    const std::optional<Key>& parent) {
  std::lock_guard<std::mutex> g(mu_);
  stats_.blocks_offered += static_cast<std::int64_t>(keys.size());
  admission_->observe(keys);
  std::uint64_t root = kRoot;
  if (parent) {
    if (const Entry* p = index_.find(*parent); p != nullptr) root = p->serial;
  }
  StoreWalk w;
  StorePlan plan;
  // vLLM's keys name their whole prefix: a cached key is the block, whatever its recorded parent.
  walk_store(
      index_, *admission_, next_serial_, keys, root, StaleKeys::kTrust, w,
      [](std::size_t, const Entry*) { return true; },
      [&](std::size_t i, Entry* e) {
        plan.accepted.push_back(i);
        plan.slots.push_back(e->slot);
        return true;
      });
  index_.touch_chain(w.chain);
  const auto rest = static_cast<std::int64_t>(keys.size() - w.stopped_at);
  if (w.stop == StoreWalk::Stop::kDeclined) stats_.blocks_declined += rest;
  if (w.stop == StoreWalk::Stop::kNoRoom) stats_.blocks_no_room += rest;
  plan.evicted = w.evicted;
  events_.removed.insert(events_.removed.end(), w.evicted.begin(), w.evicted.end());
  return plan;
}

void BlockCatalog::complete_store(std::span<const Key> keys, bool success) {
  std::lock_guard<std::mutex> g(mu_);
  for (std::size_t i = 0; i < keys.size(); ++i) {
    const Entry* e = index_.find(keys[i]);
    if (e == nullptr || e->ready) {
      throw std::invalid_argument("complete_store: " + nth(i) + " (" + keys[i].hex() +
                                  ") is not being stored");
    }
  }
  for (const Key& k : keys) {
    Entry* e = index_.find(k);
    index_.unpin(e);
    if (success) {
      e->ready = true;
      events_.stored.push_back(k);
      ++stats_.blocks_stored;
    } else {
      index_.erase(e);
      events_.removed.push_back(k);
      ++stats_.stores_failed;
    }
  }
}

BlockCatalog::Events BlockCatalog::take_events() {
  std::lock_guard<std::mutex> g(mu_);
  Events out;
  std::swap(out, events_);
  return out;
}

CatalogStats BlockCatalog::stats() const {
  std::lock_guard<std::mutex> g(mu_);
  CatalogStats s = stats_;
  s.evictions = index_.evictions();
  s.used = index_.size();
  s.pending = index_.busy();
  s.capacity = index_.capacity();
  s.admitting_second_sightings_only = admission_->wants_second_sighting();
  return s;
}

std::int64_t BlockCatalog::clear() {
  std::lock_guard<std::mutex> g(mu_);
  std::int64_t n = 0;
  // Leaves first, repeatedly: erasing a parent before its children is allowed by the index, but
  // idle entries are all erased in the end either way.
  for (const Entry* e : index_.lru_order()) {
    if (e->refs != 0) continue;
    events_.removed.push_back(e->key);
    index_.erase(const_cast<Entry*>(e));
    ++n;
  }
  return n;
}

}  // namespace hicache
