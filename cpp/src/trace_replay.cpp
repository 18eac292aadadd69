#include "hicache/trace_replay.hpp"

#include <algorithm>
#include <climits>
#include <cstring>
#include <deque>
#include <memory>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

#include "hicache/chain_walk.hpp"

namespace hicache {
namespace {

std::uint64_t mix64(std::uint64_t x) {  // splitmix64's finalizer: a bijection
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ULL;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebULL;
  x ^= x >> 31;
  return x;
}

void check(const ReplayTrace& t, std::int64_t capacity_pages) {
  if (capacity_pages < 1) throw std::invalid_argument("replay: capacity_pages must be >= 1");
  if (t.block_ids.size() != t.sub_pages.size()) {
    throw std::invalid_argument("replay: block_ids and sub_pages differ in length");
  }
  if (t.offsets.empty() || t.offsets.front() != 0 ||
      t.offsets.back() != static_cast<std::int64_t>(t.block_ids.size()) ||
      t.hit_limit.size() + 1 != t.offsets.size()) {
    throw std::invalid_argument(
        "replay: offsets must run from 0 to the number of pages, one more than hit_limit");
  }
  for (std::size_t r = 0; r + 1 < t.offsets.size(); ++r) {
    if (t.offsets[r + 1] < t.offsets[r]) {
      throw std::invalid_argument("replay: offsets must not decrease (request " +
                                  std::to_string(r) + ")");
    }
  }
}

}  // namespace

Key replay_key(std::uint64_t block_id, std::uint32_t sub_page) {
  // Bytes 8-15 hold the block id itself and bytes 0-7 a mix of it plus the sub-page, so the key
  // is injective and its first bytes (the index's hash, the ghost's fingerprint) are uniform.
  const std::uint64_t lo = mix64(block_id) + 0x9e3779b97f4a7c15ULL * (sub_page + 1ULL);
  Key k;
  std::memcpy(k.bytes.data(), &lo, sizeof lo);
  std::memcpy(k.bytes.data() + 8, &block_id, sizeof block_id);
  return k;
}

namespace {

// One cache's index and admission with the rules of HostPrefixCache::try_resume and store.
class ReplayCache {
 public:
  ReplayCache(std::int64_t capacity, EvictionPolicy eviction, Admission admission)
      : index_(capacity, eviction), policy_(make_admission_policy(admission, capacity)) {}

  // try_resume: the longest ready chain within `limit` pages; a hit touches it. Leaves the
  // chain in walk_ for store().
  std::size_t lookup(std::span<const Key> keys, std::size_t limit) {
    walk_.chain.clear();
    const std::size_t hit = walk_cached(index_, keys, limit, kRoot, walk_.chain, trust);
    index_.touch_chain(walk_.chain);
    return hit;
  }

  // store: write-through of every page the admission policy admits. The pages the lookup just
  // hit are the walk's verified prefix; nothing ran in between, so their entries are reused.
  void store(std::span<const Key> keys, ReplayResult& res) {
    policy_->observe(keys);
    walk_.fresh.clear();
    walk_.evicted.clear();
    walk_store(index_, *policy_, next_serial_, keys, kRoot, StaleKeys::kReplace, walk_, trust,
               [](std::size_t, Entry*) { return true; });
    index_.touch_chain(walk_.chain);
    if (walk_.stop == StoreWalk::Stop::kDeclined) {
      res.pages_declined += static_cast<std::int64_t>(keys.size() - walk_.stopped_at);
    }
    res.pages_stored += static_cast<std::int64_t>(walk_.fresh.size());
    for (Entry* e : walk_.fresh) {  // the null copier's copy completed: retired by the next call
      e->ready = true;
      index_.unpin(e);
    }
  }

  std::int64_t evictions() const { return index_.evictions(); }
  // Pages the last store evicted, and those it stored.
  const std::vector<Key>& evicted() const { return walk_.evicted; }
  const std::vector<Entry*>& stored() const { return walk_.fresh; }

 private:
  static constexpr std::uint64_t kRoot = 1;                      // the one salt's chain root
  static bool trust(std::size_t, const Entry*) { return true; }  // ids are the pages' identity
  PrefixIndex index_;
  std::unique_ptr<AdmissionPolicy> policy_;
  std::uint64_t next_serial_ = 2;
  StoreWalk walk_;
};

// A tier of the replay: lookup(keys, from, limit) serves the run of pages it holds from
// `from`; put(key) writes a page.
class TierModel {
 public:
  virtual ~TierModel() = default;
  virtual std::size_t lookup(std::span<const Key> keys, std::size_t from, std::size_t limit) = 0;
  virtual void put(const Key& key) = 0;
  virtual std::int64_t stored() const = 0;
};

// A shared store: pages by key, least recently used out (its values are found by name).
class LruTierModel final : public TierModel {
 public:
  explicit LruTierModel(std::int64_t capacity) : index_(capacity, EvictionPolicy::kLru) {}
  // Pages of keys[from..limit) it holds, in a run; they are marked used.
  std::size_t lookup(std::span<const Key> keys, std::size_t from, std::size_t limit) override {
    std::size_t n = 0;
    for (std::size_t i = from; i < limit; ++i, ++n) {
      Entry* e = index_.find(keys[i]);
      if (e == nullptr) break;
      index_.touch(e);
    }
    return n;
  }
  void put(const Key& key) override {
    if (Entry* e = index_.find(key)) {
      index_.touch(e);
      return;
    }
    Entry* e = index_.insert(key, next_serial_++, 0);
    if (e == nullptr) return;
    e->ready = true;
    index_.unpin(e);
    ++stored_;
  }
  std::int64_t stored() const override { return stored_; }

 private:
  PrefixIndex index_;
  std::uint64_t next_serial_ = 1;
  std::int64_t stored_ = 0;
};

// DiskTier's rule (disk_tier.hpp), in pages: appended to segments of 1/16 of the capacity, the
// oldest segment dropped when full, a page read from the older half appended again.
class DiskTierModel final : public TierModel {
 public:
  explicit DiskTierModel(std::int64_t capacity)
      : capacity_(capacity), segment_pages_(std::max<std::int64_t>(1, capacity / 16)) {}
  std::size_t lookup(std::span<const Key> keys, std::size_t from, std::size_t limit) override {
    std::size_t n = 0;
    for (std::size_t i = from; i < limit; ++i, ++n) {
      auto it = where_.find(keys[i]);
      if (it == where_.end()) break;
      if (it->second < first_ + segments_.size() / 2) append(keys[i]);  // the older half
    }
    return n;
  }
  void put(const Key& key) override {
    append(key);
    ++stored_;
  }
  std::int64_t stored() const override { return stored_; }

 private:
  void append(const Key& key) {
    if (segments_.empty() || static_cast<std::int64_t>(segments_.back().size()) == segment_pages_) {
      segments_.emplace_back();
    }
    segments_.back().push_back(key);
    where_[key] = first_ + segments_.size() - 1;
    ++pages_;
    while (pages_ > capacity_ && segments_.size() > 1) {
      for (const Key& k : segments_.front()) {
        auto it = where_.find(k);
        if (it != where_.end() && it->second == first_) where_.erase(it);
      }
      pages_ -= static_cast<std::int64_t>(segments_.front().size());
      segments_.pop_front();
      ++first_;
    }
  }
  std::int64_t capacity_, segment_pages_;
  std::deque<std::vector<Key>> segments_;  // oldest first
  std::uint64_t first_ = 0;                // the oldest segment's number
  std::int64_t pages_ = 0;                 // pages in segments, stale copies included
  std::unordered_map<Key, std::uint64_t, KeyHash> where_;  // the segment of each page's copy
  std::int64_t stored_ = 0;
};

void request_keys(const ReplayTrace& t, std::size_t r, std::vector<Key>& keys) {
  const auto begin = static_cast<std::size_t>(t.offsets[r]);
  const auto n = static_cast<std::size_t>(t.offsets[r + 1]) - begin;
  keys.resize(n);
  for (std::size_t i = 0; i < n; ++i) {
    keys[i] = replay_key(t.block_ids[begin + i], t.sub_pages[begin + i]);
  }
}

std::size_t hit_limit(const ReplayTrace& t, std::size_t r, std::size_t n) {
  return static_cast<std::size_t>(
      std::clamp<std::int64_t>(t.hit_limit[r], 0, static_cast<std::int64_t>(n)));
}

}  // namespace

ReplayResult replay_policy(const ReplayTrace& t, std::int64_t capacity_pages,
                           EvictionPolicy eviction, Admission admission) {
  check(t, capacity_pages);
  const std::size_t requests = t.hit_limit.size();
  ReplayCache cache(capacity_pages, eviction, admission);
  ReplayResult res;
  res.served_pages.assign(requests, 0);
  std::vector<Key> keys;
  for (std::size_t r = 0; r < requests; ++r) {
    request_keys(t, r, keys);
    const std::size_t h = cache.lookup(keys, hit_limit(t, r, keys.size()));
    res.served_pages[r] = static_cast<std::int64_t>(h);
    res.requests_hit += h > 0 ? 1 : 0;
    cache.store(keys, res);
  }
  res.evictions = cache.evictions();
  return res;
}

ReplayResult replay_shared(const ReplayTrace& t, std::span<const std::int32_t> instance_of,
                           std::int32_t instances, std::int64_t host_capacity_pages,
                           std::int64_t tier_capacity_pages, EvictionPolicy eviction,
                           Admission admission, TierWrite write, TierModelKind kind) {
  check(t, host_capacity_pages);
  const std::size_t requests = t.hit_limit.size();
  if (instances < 1) throw std::invalid_argument("replay: instances must be >= 1");
  if (tier_capacity_pages < 0) throw std::invalid_argument("replay: tier capacity must be >= 0");
  if (instance_of.size() != requests) {
    throw std::invalid_argument("replay: one instance per request is needed");
  }
  std::vector<std::unique_ptr<ReplayCache>> hosts;
  for (std::int32_t i = 0; i < instances; ++i) {
    hosts.push_back(std::make_unique<ReplayCache>(host_capacity_pages, eviction, admission));
  }
  std::unique_ptr<TierModel> tier;
  if (tier_capacity_pages > 0 && kind == TierModelKind::kLru) {
    tier = std::make_unique<LruTierModel>(tier_capacity_pages);
  } else if (tier_capacity_pages > 0) {
    tier = std::make_unique<DiskTierModel>(tier_capacity_pages);
  }
  ReplayResult res;
  res.served_pages.assign(requests, 0);
  res.tier_pages.assign(requests, 0);
  std::vector<Key> keys;
  for (std::size_t r = 0; r < requests; ++r) {
    const std::int32_t i = instance_of[r];
    if (i < 0 || i >= instances) {
      throw std::invalid_argument("replay: request " + std::to_string(r) + " routed to instance " +
                                  std::to_string(i) + " of " + std::to_string(instances));
    }
    ReplayCache& host = *hosts[static_cast<std::size_t>(i)];
    request_keys(t, r, keys);
    const std::size_t limit = hit_limit(t, r, keys.size());
    const std::size_t h = host.lookup(keys, limit);
    // A host miss at page h waits for the tier, which serves the run of pages it holds from h;
    // they enter the host with the rest of the prompt.
    const std::size_t from_tier = tier ? tier->lookup(keys, h, limit) : 0;
    res.served_pages[r] = static_cast<std::int64_t>(h + from_tier);
    res.tier_pages[r] = static_cast<std::int64_t>(from_tier);
    res.requests_hit += h + from_tier > 0 ? 1 : 0;
    host.store(keys, res);
    if (!tier) continue;
    if (write == TierWrite::kThrough) {  // what HostPrefixCache writes: the pages it stored
      for (const Entry* e : host.stored()) tier->put(e->key);
    } else {
      for (const Key& k : host.evicted()) tier->put(k);
    }
  }
  for (const auto& h : hosts) res.evictions += h->evictions();
  res.tier_pages_stored = tier ? tier->stored() : 0;
  return res;
}

ReplayResult replay_optimum(const ReplayTrace& t, std::int64_t capacity_pages) {
  check(t, capacity_pages);
  const std::size_t requests = t.hit_limit.size();
  const std::size_t refs = t.block_ids.size();
  // Dense ids for pages, then each reference's next use (the request that uses the page next).
  std::vector<std::int32_t> page(refs);
  std::int32_t pages = 0;
  {
    // A flat open-addressed map (block id, sub-page) -> dense id, at most half full; it grows
    // with the distinct pages, not the references (a trace reuses most of its pages).
    struct Slot {
      std::uint64_t block = 0;
      std::uint32_t sub = 0;
      std::int32_t id = -1;
    };
    auto home = [](std::uint64_t b, std::uint32_t sub, std::size_t mask) {
      return static_cast<std::size_t>(mix64(b) + 0x9e3779b97f4a7c15ULL * sub) & mask;
    };
    std::vector<Slot> map(1024);
    for (std::size_t i = 0; i < refs; ++i) {
      const std::uint64_t b = t.block_ids[i];
      const std::uint32_t sub = t.sub_pages[i];
      std::size_t mask = map.size() - 1;
      std::size_t j = home(b, sub, mask);
      while (map[j].id >= 0 && !(map[j].block == b && map[j].sub == sub)) j = (j + 1) & mask;
      if (map[j].id < 0) {
        if (pages == INT32_MAX)
          throw std::invalid_argument("replay: more than 2^31 distinct pages");
        if (2 * (static_cast<std::size_t>(pages) + 1) > map.size()) {
          std::vector<Slot> bigger(map.size() * 2);
          mask = bigger.size() - 1;
          for (const Slot& old : map) {
            if (old.id < 0) continue;
            std::size_t k = home(old.block, old.sub, mask);
            while (bigger[k].id >= 0) k = (k + 1) & mask;
            bigger[k] = old;
          }
          map.swap(bigger);
          j = home(b, sub, mask);
          while (map[j].id >= 0) j = (j + 1) & mask;
        }
        map[j] = {b, sub, pages++};
      }
      page[i] = map[j].id;
    }
  }
  constexpr std::int32_t kNever = INT32_MAX;
  std::vector<std::int32_t> next_use(refs);
  {
    std::vector<std::int32_t> last(static_cast<std::size_t>(pages), kNever);
    for (std::size_t r = requests; r-- > 0;) {
      const auto b = static_cast<std::size_t>(t.offsets[r]);
      const auto e = static_cast<std::size_t>(t.offsets[r + 1]);
      for (std::size_t i = b; i < e; ++i) next_use[i] = last[static_cast<std::size_t>(page[i])];
      for (std::size_t i = b; i < e; ++i)
        last[static_cast<std::size_t>(page[i])] = static_cast<std::int32_t>(r);
    }
  }
  // Cached pages with their (next use, depth); a max-heap of them with lazy deletion.
  struct Slot {
    std::int32_t next_use = 0;
    std::int32_t depth = -1;  // -1: not cached
  };
  struct Item {
    std::int32_t next_use, depth, page;
    bool operator<(const Item& o) const {  // the top is evicted first
      if (next_use != o.next_use) return next_use < o.next_use;
      if (depth != o.depth) return depth < o.depth;
      return page > o.page;
    }
  };
  std::vector<Slot> slot(static_cast<std::size_t>(pages));
  std::vector<Item> heap;
  std::int64_t cached = 0;
  ReplayResult res;
  res.served_pages.assign(requests, 0);
  auto valid = [&](const Item& it) {
    const Slot& s = slot[static_cast<std::size_t>(it.page)];
    return s.depth == it.depth && s.next_use == it.next_use;
  };
  auto push = [&](Item it) {
    heap.push_back(it);
    std::push_heap(heap.begin(), heap.end());
    if (heap.size() > 4 * static_cast<std::size_t>(cached) + 4096) {  // drop stale items
      std::erase_if(heap, [&](const Item& x) { return !valid(x); });
      std::make_heap(heap.begin(), heap.end());
    }
  };
  for (std::size_t r = 0; r < requests; ++r) {
    const auto b = static_cast<std::size_t>(t.offsets[r]);
    const auto n = static_cast<std::size_t>(t.offsets[r + 1]) - b;
    const auto limit = static_cast<std::size_t>(
        std::clamp<std::int64_t>(t.hit_limit[r], 0, static_cast<std::int64_t>(n)));
    std::size_t h = 0;
    while (h < limit && slot[static_cast<std::size_t>(page[b + h])].depth >= 0) ++h;
    res.served_pages[r] = static_cast<std::int64_t>(h);
    res.requests_hit += h > 0 ? 1 : 0;
    for (std::size_t i = 0; i < n; ++i) {
      const std::int32_t p = page[b + i];
      const Item mine{next_use[b + i], static_cast<std::int32_t>(i), p};
      Slot& s = slot[static_cast<std::size_t>(p)];
      if (s.depth < 0 && cached >= capacity_pages) {
        while (!valid(heap.front())) {
          std::pop_heap(heap.begin(), heap.end());
          heap.pop_back();
        }
        const Item top = heap.front();
        if (!(mine < top)) continue;  // p is needed last of all: do not cache it
        std::pop_heap(heap.begin(), heap.end());
        heap.pop_back();
        slot[static_cast<std::size_t>(top.page)].depth = -1;
        --cached;
        ++res.evictions;
      }
      if (s.depth < 0) {
        ++cached;
        ++res.pages_stored;
      }
      s = {mine.next_use, mine.depth};
      push(mine);
    }
  }
  return res;
}

}  // namespace hicache
