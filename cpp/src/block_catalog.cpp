#include "hicache/block_catalog.hpp"

#include <stdexcept>
#include <string>

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
  std::uint64_t parent_serial = kRoot;
  if (parent) {
    if (const Entry* p = index_.find(*parent); p != nullptr) parent_serial = p->serial;
  }
  StorePlan plan;
  std::vector<Entry*> chain;
  std::vector<Entry*> held;  // cached blocks of the chain, pinned while inserts may evict
  for (std::size_t i = 0; i < keys.size(); ++i) {
    if (Entry* e = index_.find(keys[i]); e != nullptr) {  // cached, or being stored
      index_.pin(e);
      held.push_back(e);
      parent_serial = e->serial;
      chain.push_back(e);
      continue;
    }
    if (!admission_->admit(i, index_.full())) {
      stats_.blocks_declined += static_cast<std::int64_t>(keys.size() - i);
      break;
    }
    std::optional<Key> evicted;
    Entry* e = index_.insert(keys[i], next_serial_++, parent_serial, &evicted);
    if (e == nullptr) {
      stats_.blocks_no_room += static_cast<std::int64_t>(keys.size() - i);
      break;
    }
    if (evicted) {
      plan.evicted.push_back(*evicted);
      events_.removed.push_back(*evicted);
    }
    plan.accepted.push_back(i);
    plan.slots.push_back(e->slot);
    parent_serial = e->serial;
    chain.push_back(e);
  }
  for (Entry* e : held) index_.unpin(e);
  index_.touch_chain(chain);
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
