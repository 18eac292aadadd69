#include "hicache/prefix_index.hpp"

#include <algorithm>
#include <stdexcept>

namespace hicache {

PrefixIndex::PrefixIndex(std::int64_t capacity, EvictionPolicy policy)
    : capacity_(capacity), policy_(policy) {
  if (capacity < 0) throw std::invalid_argument("index capacity must be >= 0");
  // Nothing is sized from the capacity: an idle cache of any capacity costs a few bytes, and the
  // map grows with what is stored (rehashing keeps entries where they are).
}

Entry* PrefixIndex::find(const Key& key) { return table_.find(key); }

namespace {

// The edge table's key for (parent serial, content fingerprint); never 0 (Entry::edge's "none").
std::uint64_t edge_key(std::uint64_t parent_serial, std::uint64_t fingerprint) {
  const std::uint64_t k =
      fingerprint ^ (parent_serial * 0x9E3779B97F4A7C15ULL + 0x632BE59BD9B4E019ULL);
  return k == 0 ? 1 : k;
}

}  // namespace

// An entry's edge is nonzero only while it holds that edge in edges_.
void PrefixIndex::add_edge(Entry* e, std::uint64_t fingerprint) {
  const std::uint64_t k = edge_key(e->parent_serial, fingerprint);
  if (e->edge == k) return;
  if (e->edge != 0) {  // its content changed: the old edge goes
    edges_.erase(e);
    e->edge = 0;
  }
  if (edges_.find(k) != nullptr) return;  // another entry's: this one is found by key
  e->edge = k;
  edges_.insert(e);
}

Entry* PrefixIndex::find_edge(std::uint64_t parent_serial, std::uint64_t fingerprint) const {
  return edges_.find(edge_key(parent_serial, fingerprint));
}

void PrefixIndex::drop(Entry* e) {
  if (e->edge != 0) {
    edges_.erase(e);
    e->edge = 0;
  }
  forget_child(e);
  unlink(e);
  table_.erase(e);
  e->tokens.clear();
  free_entries_.push_back(e);
}

std::int64_t PrefixIndex::take_slot(std::optional<Key>* evicted) {
  if (!free_slots_.empty()) {
    const std::int64_t s = free_slots_.back();
    free_slots_.pop_back();
    return s;
  }
  if (next_unused_slot_ < capacity_) return next_unused_slot_++;
  const bool leaves_only = policy_ == EvictionPolicy::kLeafFirst;
  for (Entry* e = lru_head_; e != nullptr; e = e->lru_next) {
    if (e->refs == 0 && !(leaves_only && children_.contains(e->serial))) {
      const std::int64_t s = e->slot;
      if (evicted != nullptr) *evicted = e->key;
      drop(e);
      ++evictions_;
      prefetch_next_victim();
      return s;
    }
  }
  return -1;
}

// A store into a full pool evicts a page for each page it inserts, and each eviction touches
// memory no recent call did: the victim's entry, its table slots (key, content edge, its
// parent's child count) and the token buffer its reuse overwrites. The next victim is most
// likely the least recently used entry now: its memory is fetched while the store places this
// page, and the entry after it one eviction earlier still, so that reading its key to find its
// slots does not wait either.
void PrefixIndex::prefetch_next_victim() const {
  const Entry* v = lru_head_;
  if (v == nullptr) return;
  if (const Entry* after = v->lru_next; after != nullptr) {  // both lines it may span
    __builtin_prefetch(after);
    __builtin_prefetch(reinterpret_cast<const char*>(after) + sizeof(Entry) - 1);
  }
  table_.prefetch(v->key);
  if (v->edge != 0) edges_.prefetch(v->edge);
  children_.prefetch(v->serial);
  children_.prefetch(v->parent_serial);
  const auto* tokens = reinterpret_cast<const char*>(v->tokens.data());
  const std::size_t bytes =
      std::min<std::size_t>(v->tokens.capacity() * sizeof(std::int32_t), 1024);
  for (std::size_t b = 0; b < bytes; b += 64) __builtin_prefetch(tokens + b, 1);  // to be written
}

Entry* PrefixIndex::insert(const Key& key, std::uint64_t serial, std::uint64_t parent_serial,
                           std::optional<Key>* evicted) {
  if (evicted != nullptr) evicted->reset();
  if (table_.find(key) != nullptr) {
    throw std::logic_error("PrefixIndex::insert: key already present");
  }
  const std::int64_t slot = take_slot(evicted);
  if (slot < 0) return nullptr;
  Entry* reused = nullptr;
  if (!free_entries_.empty()) {
    reused = free_entries_.back();
    free_entries_.pop_back();
  }
  Entry& e = reused != nullptr ? *reused : entries_.emplace_back();
  e.key = key;
  e.serial = serial;
  e.parent_serial = parent_serial;
  e.slot = slot;
  e.refs = 1;
  ++busy_;
  e.ready = false;
  e.unchecked.reset();
  children_.add(parent_serial);
  table_.insert(&e);
  link_mru(&e);
  return &e;
}

void PrefixIndex::forget_child(const Entry* e) { children_.remove(e->parent_serial); }

void PrefixIndex::erase(Entry* e) {
  if (e->refs != 0) throw std::logic_error("PrefixIndex::erase: entry is held by a transfer");
  free_slots_.push_back(e->slot);
  drop(e);
}

void PrefixIndex::unpin(Entry* e) {
  if (e->refs <= 0) throw std::logic_error("PrefixIndex::unpin: entry is not held");
  if (--e->refs == 0) --busy_;
}

void PrefixIndex::touch(Entry* e) {
  if (e == lru_tail_) return;
  unlink(e);
  link_mru(e);
}

void PrefixIndex::touch_chain(std::span<Entry* const> chain) {
  if (policy_ == EvictionPolicy::kLeafFirst) {
    for (auto it = chain.rbegin(); it != chain.rend(); ++it) touch(*it);
  } else {
    for (Entry* e : chain) touch(e);
  }
}

std::vector<const Entry*> PrefixIndex::lru_order() const {
  std::vector<const Entry*> out;
  out.reserve(table_.size());
  for (const Entry* e = lru_head_; e != nullptr; e = e->lru_next) out.push_back(e);
  return out;
}

void PrefixIndex::link_mru(Entry* e) {
  e->lru_prev = lru_tail_;
  e->lru_next = nullptr;
  if (lru_tail_ != nullptr) lru_tail_->lru_next = e;
  lru_tail_ = e;
  if (lru_head_ == nullptr) lru_head_ = e;
}

void PrefixIndex::unlink(Entry* e) {
  if (e->lru_prev != nullptr) e->lru_prev->lru_next = e->lru_next;
  if (e->lru_next != nullptr) e->lru_next->lru_prev = e->lru_prev;
  if (lru_head_ == e) lru_head_ = e->lru_next;
  if (lru_tail_ == e) lru_tail_ = e->lru_prev;
  e->lru_prev = e->lru_next = nullptr;
}

}  // namespace hicache
