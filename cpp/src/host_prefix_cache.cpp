#include "hicache/host_prefix_cache.hpp"

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <string>
#include <thread>

#include "chain_hasher.hpp"
#include "hicache/chain_walk.hpp"
#include "hicache/cpu_copier.hpp"
#include "hicache/cuda_copier.hpp"
#include "hicache/error.hpp"
#include "hicache/hash_chain.hpp"
#include "hicache/tier_record.hpp"
#include "layer_queue.hpp"
#include "page_checksum.hpp"
#include "page_fingerprint.hpp"
#include "page_threads.hpp"
#include "slot_order.hpp"
#include "tier_link.hpp"

namespace hicache {
namespace {

// Keys a lookup hashes before its first walk (try_resume hashes more only while pages match),
// and the pages of a store's first installment.
constexpr std::int64_t kFirstKeys = 16;

// Copies a state's parts between the engine's buffers and one host slot, back to back.
void copy_state(Copier& copier, Direction dir, const StateBuffers& state, std::byte* slot,
                StreamHandle stream) {
  for (const DeviceBuffer& part : state.parts) {
    copier.copy_bytes(dir, part, slot, stream);
    slot += part.bytes;
  }
}

bool same_tokens(const std::vector<std::int32_t>& a, std::span<const std::int32_t> b) {
  return a.size() == b.size() && std::equal(a.begin(), a.end(), b.begin());
}

// Extends `chain` along the prompt's pages [chain.size(), limit) with the pages the index holds
// under the chain's last page (the first under `root`) with the same tokens, found by content:
// nothing is hashed. The same pages, in the same order, as the keyed walks find (a page's key is
// a function of its tokens and its parent's key, so the entry under (parent, tokens) is the one
// under the key), as far as content reaches: a page whose edge another entry holds is found by
// key only, so callers go on with the keyed walk from where this stops. `ready_only`: a lookup
// serves only completed pages; a store's walk also goes through pages another request's copy
// is still filling (walk_store does). Returns chain.size().
std::size_t walk_by_content(PrefixIndex& index, std::span<const std::int32_t> tokens,
                            std::size_t block_tokens, std::size_t limit, std::uint64_t root,
                            std::vector<Entry*>& chain, bool ready_only) {
  std::uint64_t parent = chain.empty() ? root : chain.back()->serial;
  for (std::size_t i = chain.size(); i < limit; ++i) {
    const auto page = tokens.subspan(i * block_tokens, block_tokens);
    Entry* e = index.find_edge(parent, detail::page_fingerprint(page));
    if (e == nullptr || e->parent_serial != parent || (ready_only && !e->ready) ||
        !same_tokens(e->tokens, page)) {
      break;
    }
    chain.push_back(e);
    parent = e->serial;
  }
  return chain.size();
}

}  // namespace

struct HostPrefixCache::TierSide {
  // Host slots for pages [from, from + n) of a fetch (TierLink::Host::reserve). Lock held.
  static std::vector<TierLink::Slot> reserve(HostPrefixCache& c, const TierLink::FetchSpec& spec,
                                             std::size_t from, std::size_t n,
                                             std::span<const TierLink::Slot> pending) {
    const auto B = static_cast<std::size_t>(c.config_.block_tokens);
    const auto same = [&](std::size_t i, const Entry* e) {
      return same_tokens(e->tokens, spec.prompt.subspan(i * B, B));
    };
    const std::uint64_t root = c.intern_root(spec.salt);
    // The chain before `from`: the cached prefix (walked again: the lock was released since),
    // then the previous round's pages, pending and pinned until that round is published.
    StoreWalk w;
    const std::size_t cached = from - pending.size();
    walk_cached(c.pages_, spec.keys, cached, root, w.chain, same);
    if (w.chain.size() < cached) return {};  // the pages before them were evicted meanwhile
    for (const TierLink::Slot& p : pending) w.chain.push_back(p.entry);
    bool unpinned = false;
    walk_store(c.pages_, *c.admit_all_, c.next_serial_, spec.keys.first(from + n), root,
               StaleKeys::kReplace, w, same, [&](std::size_t i, Entry* e) {
                 if (c.host_slot(c.mover_.pool(), e->slot, unpinned) == nullptr) return false;
                 const auto toks = spec.prompt.subspan(i * B, B);
                 e->tokens.assign(toks.begin(), toks.end());
                 c.pages_.add_edge(e, detail::page_fingerprint(toks));
                 return true;
               });
    // Fresh entries (pending, pinned by the walk) get values; pages host memory had are pinned
    // here so that they outlive the round.
    std::vector<TierLink::Slot> round;
    std::size_t f = 0;
    for (std::size_t i = from; i < w.chain.size(); ++i) {
      Entry* e = w.chain[i];
      const bool fresh = f < w.fresh.size() && w.fresh[f] == e;
      if (fresh) {
        ++f;
      } else {
        c.pages_.pin(e);
      }
      round.push_back({e, fresh ? c.mover_.pool().slot(e->slot) : nullptr, fresh, std::nullopt});
    }
    return round;
  }

  // A round's checked pages published, the rest dropped (TierLink::Host::publish). Lock held.
  static std::size_t publish(HostPrefixCache& c, std::span<const TierLink::Slot> round,
                             std::size_t good) {
    // The first `good` fetched pages were checked where they landed: ready now. From the first
    // that failed on, fetched entries are erased, deepest first, so nothing unchecked is served.
    std::size_t kept = round.size(), fetched = 0;
    for (std::size_t j = 0; j < round.size(); ++j) {
      if (!round[j].fetch) continue;
      if (fetched++ == good) kept = j;
    }
    for (std::size_t j = round.size(); j-- > 0;) {
      Entry* e = round[j].entry;
      c.pages_.unpin(e);
      if (!round[j].fetch) continue;
      if (j < kept) {
        e->ready = true;
        e->unchecked = round[j].unchecked;  // its first load checks its bytes
      } else {
        c.pages_.erase(e);
      }
    }
    std::vector<Entry*> chain;
    for (std::size_t j = 0; j < kept; ++j) chain.push_back(round[j].entry);
    c.pages_.touch_chain(chain);
    c.stats_.tier_pages_fetched += static_cast<std::int64_t>(std::min(good, fetched));
    return kept;
  }
};

HostPrefixCache::HostPrefixCache(std::vector<Segment> segments, Device device, CacheConfig config,
                                 std::shared_ptr<Copier> copier, std::shared_ptr<Tier> tier)
    : config_(config.normalized()),
      state_parts_(config_.state_part_bytes()),
      tier_gate_(tier ? TierGate::of(tier) : nullptr),
      // Pinning is slow: pinned pools are pinned at start-up, or in the background from
      // start-up on, off the engine's thread (see CacheConfig::pin_upfront). With a tier, each
      // slot has room for its page's record, and the tier is told about the pool's memory.
      mover_(
          std::move(segments), device, config_.capacity_pages, std::move(copier), nullptr,
          config_.pool_chunk_bytes, !config_.pin_upfront,
          tier_gate_ ? tier_record_bytes(config_.block_tokens) : 0,
          [gate = tier_gate_](std::shared_ptr<HostAllocator> memory) {
            return gate ? tier_memory(std::move(memory), gate) : memory;
          },
          tier_gate_ ? tier_gate_->tier->value_alignment() : 0),
      catalog_({config_.capacity_pages, config_.eviction, config_.admission}),
      states_(config_.state_bytes > 0 ? config_.capacity_states : 0) {
  if (mover_.layout().segments().empty()) {
    if (config_.state_bytes == 0) {
      throw std::invalid_argument(
          "at least one KV segment is required (a cache without segments stores states alone: "
          "give state_bytes and capacity_states)");
    }
    if (tier_gate_) {
      throw std::invalid_argument("a state-only cache (no segments) has no pages for a tier");
    }
  }
  if (tier_gate_ && config_.key_bits != 128) {
    // Host memory stays exact under any collision (it compares every page's tokens and its
    // parent entry), but a tier's value names its prefix only through the parent's key: where
    // two prefixes' keys collide, a later page written under one passes the other's record.
    // With 128-bit chain keys that takes a collision of BLAKE2b; with fewer bits it is common.
    throw std::invalid_argument(
        "key_bits must be 128 with a tier (got " + std::to_string(config_.key_bits) +
        "): a tier's records name a page's prefix only by its parent's key, so shortened keys "
        "that collide could serve another prefix's page");
  }
  if (tier_gate_ && dynamic_cast<const NullCopier*>(&mover_.copier()) != nullptr) {
    // Its host slots are fake addresses: a tier's records and values would be written there.
    throw std::invalid_argument(
        "tier: the null copier's host slots hold no bytes to write to a tier or fetch into (it "
        "is for replays, which model tiers themselves: hicache.replay)");
  }
  if (!config_.layer_segments.empty()) {
    const std::size_t n = mover_.layout().segments().size();
    layer_starts_.push_back(0);
    for (std::int64_t k : config_.layer_segments) layer_starts_.push_back(layer_starts_.back() + k);
    if (layer_starts_.back() != n) {
      throw std::invalid_argument("layer_segments must add up to the " + std::to_string(n) +
                                  " segments (they add up to " +
                                  std::to_string(layer_starts_.back()) + ")");
    }
  }
  auto alloc = mover_.copier().host_allocator();
  const auto growth = HostPool::growth_for(*alloc, !config_.pin_upfront);
  if (config_.state_bytes > 0) {
    state_pool_ = std::make_unique<HostPool>(static_cast<std::size_t>(config_.state_bytes),
                                             config_.capacity_states, config_.pool_chunk_bytes,
                                             alloc, growth);
  }
  if (tier_gate_) {
    admit_all_ = make_admission_policy(Admission::kAlways, config_.capacity_pages);
    tier_space_ =
        tier_space(config_.tier.space, mover_.layout(), config_.block_tokens, config_.key_bits);
    TierLink::Host host;
    host.release = [this](const std::vector<Entry*>& entries) {
      std::lock_guard<std::mutex> g(mu_);
      for (Entry* e : entries) pages_.unpin(e);
    };
    host.reserve = [this](const TierLink::FetchSpec& spec, std::size_t from, std::size_t n,
                          std::span<const TierLink::Slot> pending) {
      std::lock_guard<std::mutex> g(mu_);
      return TierSide::reserve(*this, spec, from, n, pending);
    };
    host.publish = [this](std::span<const TierLink::Slot> round, std::size_t good) {
      std::lock_guard<std::mutex> g(mu_);
      return TierSide::publish(*this, round, good);
    };
    // A fetched page's bytes are checked by its first load, not when they arrive: the CPU
    // copier sums them as it copies them anyway, and where the copier does not (the CUDA
    // copier), the load sums them on the page threads while its copy crosses the link
    // (check_beside_load). Checked on arrival, a get's last pages were checked after it with
    // nothing else to do, and a round of its own (TierLink's edge round) cost one more batch.
    // Not for caches that load layer by layer: a layer's bytes would reach the engine before
    // the whole page was checked.
    const bool check_on_load = config_.layer_segments.empty();
    link_ = std::make_unique<TierLink>(tier_gate_, config_.tier, tier_space_,
                                       mover_.layout().page_bytes(), config_.block_tokens,
                                       check_on_load, std::move(host));
    const Copier& copier = mover_.copier();
    if (!copier.sums_pages(mover_.layout()) && copier.sums_on_device(mover_.layout())) {
      try {
        slot_sums_ = std::make_unique<SlotSums>(mover_.copier().host_allocator(),
                                                static_cast<std::size_t>(config_.capacity_pages));
      } catch (const std::exception&) {
        // No pinned memory for the sums: the tier thread sums each page before its put.
      }
    }
  }
}

HostPrefixCache::SlotSums::SlotSums(std::shared_ptr<HostAllocator> m, std::size_t slots)
    : memory(std::move(m)), bytes(std::max<std::size_t>(1, slots) * sizeof(std::uint64_t)) {
  sums = static_cast<std::uint64_t*>(memory->allocate(bytes));
}

HostPrefixCache::SlotSums::~SlotSums() { memory->deallocate(sums, bytes); }

HostPrefixCache::~HostPrefixCache() {
  link_.reset();  // writes what is queued; its callbacks take the lock below
  std::lock_guard<std::mutex> g(mu_);
  // Host slots must outlive every copy that reads or writes them.
  for (Transfer& t : transfers_) {
    if (t.fence) t.fence->wait();
  }
}

// --- bookkeeping -------------------------------------------------------------------------------

std::uint64_t HostPrefixCache::intern_root(std::string_view salt) {
  if (auto it = roots_.find(salt); it != roots_.end()) return it->second;
  // A salt costs memory only while a page uses it: roots no page 0 names any more are dropped
  // here, each time the map has doubled, so a server with per-request salts stays bounded.
  if (roots_.size() >= roots_sweep_at_) {
    std::erase_if(roots_, [&](const auto& r) { return !pages_.has_children(r.second); });
    roots_sweep_at_ = std::max<std::size_t>(64, 2 * roots_.size());
  }
  return roots_.emplace(std::string(salt), next_serial_++).first->second;
}

std::uint64_t HostPrefixCache::find_root(std::string_view salt) const {
  auto it = roots_.find(salt);
  return it == roots_.end() ? 0 : it->second;
}

void HostPrefixCache::note_request(std::string_view request_id) {
  requests_.try_emplace(std::string(request_id), 0);
}

std::byte* HostPrefixCache::host_slot(HostPool& pool, std::int64_t slot, bool& unpinned) {
  try {
    std::byte* p = pool.slot(slot);
    unpinned = unpinned || p == nullptr;  // its chunk is not pinned yet
    return p;
  } catch (const Error& err) {
    note_error(err.what());  // the allocation failed: counted, and the store skips
    return nullptr;
  }
}

void HostPrefixCache::note_error(const std::string& what) {
  ++stats_.errors;
  stats_.last_error = what;
  if (++consecutive_errors_ >= config_.error_limit && !disabled_) {
    disabled_ = true;
    stats_.disabled = true;
    stats_.disabled_reason = "disabled after " + std::to_string(consecutive_errors_) +
                             " consecutive cache errors; last: " + what;
    std::fprintf(stderr, "hicache: %s\n", stats_.disabled_reason.c_str());
  }
}

HostPrefixCache::Transfer* HostPrefixCache::register_transfer(Transfer t, StreamHandle stream,
                                                              bool failed) {
  try {
    if (!t.fence) t.fence = mover_.copier().record(stream);
  } catch (const Error& e) {
    // Without a fence nobody can tell when the enqueued copies finish: the entries stay held so
    // their slots are never reused under a copy.
    note_error(e.what());
    return nullptr;
  }
  if (failed && t.is_store) t.discard = true;
  ++requests_[t.request];
  transfers_.push_back(std::move(t));
  return &transfers_.back();
}

void HostPrefixCache::finish(Transfer& t) {
  auto settle = [&](PrefixIndex& index, std::vector<Entry*>& entries) {
    for (Entry* e : entries) {
      index.unpin(e);
      if (!t.is_store) continue;
      if (!t.discard) {
        e->ready = true;
      } else if (e->refs == 0) {
        index.erase(e);
      }
    }
  };
  // What a store did is known now: published, or discarded (forgotten, raised, failed).
  if (t.is_store) {
    (t.discard ? stats_.pages_discarded : stats_.pages_stored) +=
        static_cast<std::int64_t>(t.pages.size());
    (t.discard ? stats_.states_discarded : stats_.states_stored) +=
        static_cast<std::int64_t>(t.states.size());
  }
  settle(pages_, t.pages);
  settle(states_, t.states);
  if (link_ && t.is_store && !t.discard && !t.pages.empty()) write_to_tier(t);
  if (!t.discard) {
    const std::chrono::duration<double, std::micro> took =
        std::chrono::steady_clock::now() - t.started;
    (t.is_store ? stats_.store_latency : stats_.load_latency).record(took.count());
  }
  auto r = requests_.find(t.request);
  if (r != requests_.end()) --r->second;
}

void HostPrefixCache::write_to_tier(Transfer& t) {
  std::vector<TierLink::PutPage> puts;
  puts.reserve(t.pages.size());
  for (std::size_t j = 0; j < t.pages.size(); ++j) {
    Entry* e = t.pages[j];
    pages_.pin(e);  // until its value was put
    std::optional<std::uint64_t> sum;
    if (slot_sums_) {
      sum = slot_sums_->sums[e->slot];  // the store's fence is done: the device wrote it
    } else if (!t.checksums.empty()) {
      sum = t.checksums[j];
    }
    puts.push_back({e, e->key, t.parents[j], e->tokens, mover_.pool().slot(e->slot), sum});
  }
  if (!link_->offer(puts)) {
    for (Entry* e : t.pages) pages_.unpin(e);
  }
}

std::int64_t HostPrefixCache::retire_completed() {
  std::int64_t n = 0;
  // The stores retired here reach the tier thread together, as one write (TierLink::run): its
  // offers are held from the first store retired on (no lock taken on a pass that retires none).
  struct Held {
    TierLink* link = nullptr;
    void take(TierLink* l) {
      if (link == nullptr && l != nullptr) (link = l)->hold_offers(true);
    }
    ~Held() {
      if (link) link->hold_offers(false);
    }
  } held;
  for (auto it = transfers_.begin(); it != transfers_.end();) {
    if (it->open) {  // its store() is still running: it decides whether to publish
      ++it;
      continue;
    }
    bool done = false;
    try {
      done = it->fence->done();
    } catch (const Error& e) {
      // The device failed the copy: never publish what it stored.
      note_error(e.what());
      it->discard = true;
      done = true;
    }
    if (!done) {
      ++it;
      continue;
    }
    if (it->is_store) held.take(link_.get());
    finish(*it);
    it = transfers_.erase(it);
    ++n;
  }
  return n;
}

// --- resume ------------------------------------------------------------------------------------

std::int64_t HostPrefixCache::try_resume(std::string_view request_id,
                                         std::span<const std::int32_t> prompt,
                                         const AllocateFn& allocate, StreamHandle stream,
                                         std::optional<StateBuffers> state_out,
                                         std::optional<std::string_view> salt,
                                         LayerwiseLoad* layerwise) {
  if (prompt.empty()) throw std::invalid_argument("try_resume: the prompt is empty");
  if (layerwise != nullptr) {
    if (layer_starts_.empty()) {
      throw std::invalid_argument(
          "try_resume: a layer-wise load needs the cache's layer_segments (the segments of each "
          "layer)");
    }
    *layerwise = LayerwiseLoad();
  }
  const bool has_state = config_.state_bytes > 0;
  if (has_state) {
    if (!state_out) {
      throw std::invalid_argument("try_resume: this cache stores model state (state_bytes=" +
                                  std::to_string(config_.state_bytes) + "); pass state_out");
    }
    check_state_buffers(*state_out, state_parts_, mover_.layout().device(),
                        "try_resume: state_out");
  }
  const std::int64_t B = config_.block_tokens;
  const auto n_prompt = static_cast<std::int64_t>(prompt.size());
  const std::int64_t max_pages = std::max<std::int64_t>(0, n_prompt - config_.keep_tokens) / B;
  const std::string_view chain_salt = salt.value_or(std::string_view(config_.salt));

  std::unique_lock<std::mutex> lock(mu_);
  retire_completed();
  note_request(request_id);
  ++stats_.lookups;
  stats_.lookup_tokens += n_prompt;
  if (disabled_ || max_pages == 0) return 0;

  // Cached pages are found by content (walk_by_content): their keys are their entries', and
  // nothing is hashed. Past them, a page may still be cached under its key, so the keyed walk
  // goes on from there, hashing in doubling installments (16, 32, 64... pages) while pages
  // match: a lookup that misses there hashes 16 pages (~13 us on an H200's host, under the lock:
  // nothing walked before an unlock could be trusted after it). Each installment's token blocks
  // are hashed four pages side by side, on the page threads once they are enough bytes
  // (ChainHasher).
  const std::uint64_t root = find_root(chain_salt);
  std::vector<Entry*> matched;
  walk_by_content(pages_, prompt, static_cast<std::size_t>(B), static_cast<std::size_t>(max_pages),
                  root, matched, /*ready_only=*/true);
  std::vector<Key> keys;
  keys.reserve(matched.size() + kFirstKeys);
  for (const Entry* e : matched) keys.push_back(e->key);
  const auto same_page = [&](std::size_t i, const Entry* e) {  // exact: the tokens, not the hash
    return same_tokens(
        e->tokens, prompt.subspan(i * static_cast<std::size_t>(B), static_cast<std::size_t>(B)));
  };
  detail::ChainHasher hasher(chain_salt, prompt, B, max_pages, config_.key_bits);
  for (std::int64_t step = kFirstKeys;
       matched.size() == keys.size() && static_cast<std::int64_t>(keys.size()) < max_pages;
       step *= 2) {
    hasher.extend(keys, std::min(max_pages, static_cast<std::int64_t>(keys.size()) + step));
    // Root 0 (no page under this salt) matches no entry: every serial is >= 1.
    walk_cached(pages_, keys, keys.size(), root, matched, same_page);
  }
  // A host miss before the cap: the rest of the prefix may be in the shared tier. Fetched pages
  // enter host memory like stored ones, then the walk runs again and serves them.
  std::size_t from_tier = matched.size();  // pages before this one came from host memory
  if (link_ && !has_state && static_cast<std::int64_t>(matched.size()) < max_pages) {
    if (config_.tier.wait_us == 0) {
      // Prefetch: serve what host memory has now; the next prompt finds the rest here.
      link_->prefetch({{prompt.begin(), prompt.end()},
                       std::string(chain_salt),
                       from_tier,
                       max_pages,
                       config_.key_bits,
                       keys});  // the tier thread hashes the rest
    } else {
      lock.unlock();
      hasher.extend(keys, max_pages);
      const auto deadline =
          TierLink::Clock::now() + std::chrono::microseconds(config_.tier.wait_us);
      link_->fetch_into({keys, prompt, chain_salt}, from_tier, deadline);
      lock.lock();
      if (disabled_) return 0;
      matched.clear();  // the lock was released: walk again
      walk_cached(pages_, keys, keys.size(), find_root(chain_salt), matched, same_page);
    }
  }
  Entry* state = nullptr;
  std::size_t h = matched.size();
  if (has_state) {
    for (; h > 0; --h) {
      Entry* s = states_.find(keys[h - 1]);
      if (s != nullptr && s->ready && s->parent_serial == matched[h - 1]->serial) {
        state = s;
        break;
      }
    }
  }
  if (h == 0) return 0;
  matched.resize(h);

  // Held across the unlocked allocate call so nothing evicts them meanwhile.
  for (Entry* e : matched) pages_.pin(e);
  if (state) states_.pin(state);
  auto release = [&] {
    for (Entry* e : matched) pages_.unpin(e);
    if (state) states_.unpin(state);
  };
  std::optional<std::vector<std::int64_t>> blocks;
  lock.unlock();
  std::size_t worth = h;
  try {
    worth = worth_loading(h, n_prompt, layerwise != nullptr, has_state);
  } catch (...) {
    lock.lock();
    release();
    throw;
  }
  if (worth < h) {
    lock.lock();
    ++stats_.hits_trimmed;
    stats_.pages_recomputed += static_cast<std::int64_t>(h - worth);
    if (worth == 0) {
      release();
      return 0;
    }
    for (std::size_t i = worth; i < h; ++i) pages_.unpin(matched[i]);
    matched.resize(worth);  // whole_or_nothing with a state: worth == h or 0
    h = worth;
    lock.unlock();
  }
  const auto tokens = static_cast<std::int64_t>(h) * B;
  try {
    blocks = allocate(tokens);
  } catch (...) {
    lock.lock();
    release();
    throw;
  }
  lock.lock();
  if (!blocks) {
    release();
    ++stats_.deferred;
    if (layerwise) layerwise->tokens_ = -1;
    return -1;
  }
  try {
    if (blocks->size() != h) {
      throw std::invalid_argument("allocate(" + std::to_string(tokens) +
                                  ")'s result: " + std::to_string(blocks->size()) +
                                  " block ids; expected " + std::to_string(h) + " (one per " +
                                  std::to_string(B) + "-token page)");
    }
    mover_.layout().check_blocks(*blocks, /*require_unique=*/true,
                                 "allocate(" + std::to_string(tokens) + ")'s result");
  } catch (...) {
    release();
    throw;
  }
  if (disabled_) {
    release();
    return 0;
  }

  Transfer t;
  t.request = std::string(request_id);
  if (state) t.states.push_back(state);
  bool failed = false;
  // Pages fetched from the tier whose bytes are not checked yet are checked by this load (see
  // UncheckedSums): the CPU copier sums them as it copies them, and is done when it returns; the
  // CUDA copier's device sums them where they landed when the stream had nothing else queued;
  // otherwise the page threads sum their host slots while the copy crosses the link.
  std::vector<std::size_t> unchecked;  // indices into matched
  for (std::size_t i = 0; i < h; ++i) {
    if (matched[i]->unchecked) unchecked.push_back(i);
  }
  std::vector<std::optional<std::uint64_t>> sums(unchecked.empty() ? 0 : h);
  const UncheckedSums how =
      unchecked.empty() ? UncheckedSums::kNone : unchecked_sums(stream, layerwise != nullptr);
  std::vector<PageMove> moves(h);
  try {
    for (std::size_t i = 0; i < h; ++i) {
      moves[i] = {(*blocks)[i], mover_.pool().slot(matched[i]->slot)};
    }
    for (std::size_t i : unchecked) {
      if (how == UncheckedSums::kCopier) moves[i].checksum = &sums[i];
      if (how == UncheckedSums::kDevice)
        moves[i].sum_at_fence = slot_sums_->sums + matched[i]->slot;
    }
    t.fence = enqueue_load(moves, state ? &*state_out : nullptr,
                           state ? state_pool_->slot(state->slot) : nullptr, stream, layerwise);
    if (how == UncheckedSums::kDevice) t.fence = mover_.copier().record(stream);
  } catch (const Error& e) {
    note_error(e.what());
    failed = true;
  }
  if (!failed && (how == UncheckedSums::kDevice || how == UncheckedSums::kPageThreads)) {
    // Unlocked: the matched entries are pinned, so nothing evicts them or reuses their slots,
    // and other calls need not wait for a pass over every page.
    lock.unlock();
    std::string failure;
    if (how == UncheckedSums::kDevice) {
      t.fence->wait();
      try {
        (void)t.fence->done();  // done now; throws if the device failed
      } catch (const Error& e) {
        failure = e.what();
      }
    } else {
      sum_host_slots(unchecked, moves, sums);
    }
    lock.lock();
    if (!failure.empty()) {
      note_error(failure);
      failed = true;
    } else if (how == UncheckedSums::kDevice) {
      for (std::size_t i : unchecked) sums[i] = slot_sums_->sums[matched[i]->slot];
      stats_.tier_pages_checked_on_device += static_cast<std::int64_t>(unchecked.size());
    }
  }
  if (!failed && !sums.empty()) h = check_loaded(matched, sums, stream);
  t.pages = matched;
  register_transfer(std::move(t), stream, failed);
  if (failed || h == 0) {
    if (layerwise) *layerwise = LayerwiseLoad();
    return 0;
  }
  const auto served = static_cast<std::int64_t>(h) * B;
  note_success();
  if (layerwise) {
    layerwise->tokens_ = served;
    ++stats_.layerwise_loads;
  }
  pages_.touch_chain(matched);
  if (state) states_.touch(state);
  ++stats_.hits;
  stats_.hit_tokens += served;
  if (h > from_tier) stats_.tier_hit_tokens += static_cast<std::int64_t>(h - from_tier) * B;
  stats_.pages_loaded += static_cast<std::int64_t>(h);
  stats_.states_loaded += state ? 1 : 0;
  return served;
}

HostPrefixCache::UncheckedSums HostPrefixCache::unchecked_sums(StreamHandle stream,
                                                               bool layerwise) {
  const Copier& copier = mover_.copier();
  if (copier.sums_pages(mover_.layout())) return UncheckedSums::kCopier;
  if (layerwise || slot_sums_ == nullptr || !copier.sums_on_device(mover_.layout())) {
    return UncheckedSums::kPageThreads;
  }
  // Summed on the device, the call waits for the stream to reach the end of the load: only when
  // the stream has nothing queued before it, so that a hit never waits for the engine's work.
  try {
    return mover_.copier().record(stream)->done() ? UncheckedSums::kDevice
                                                  : UncheckedSums::kPageThreads;
  } catch (const Error&) {
    return UncheckedSums::kPageThreads;  // the load's own calls report the device's failure
  }
}

void HostPrefixCache::sum_host_slots(std::span<const std::size_t> unchecked,
                                     std::span<const PageMove> moves,
                                     std::span<std::optional<std::uint64_t>> sums) const {
  const auto page_bytes = static_cast<std::size_t>(mover_.layout().page_bytes());
  detail::for_each_page(
      unchecked.size(), page_bytes,
      [&](std::size_t k) {
        const std::size_t i = unchecked[k];
        sums[i] = page_checksum({moves[i].host, page_bytes});
      },
      detail::kTierBytesPerThread, detail::kTierPageThreads);
}

std::size_t HostPrefixCache::check_loaded(std::vector<Entry*>& matched,
                                          std::span<const std::optional<std::uint64_t>> sums,
                                          StreamHandle stream) {
  std::size_t good = matched.size();
  for (std::size_t i = 0; i < matched.size(); ++i) {
    Entry* e = matched[i];
    if (!e->unchecked) continue;
    if (sums[i] != e->unchecked) {
      good = i;
      break;
    }
    e->unchecked.reset();  // checked: a page like any other now
  }
  if (good == matched.size()) return good;
  // The engine's blocks from `good` on hold bytes this call does not report loaded; the page
  // that failed leaves host memory (its descendants, under it, can no longer be reached).
  link_->note_rejected("page bytes do not match their checksum (overwritten or torn)");
  // Once erased, its slot may be taken at once: not before a load still reading it has ended
  // (a copier whose copies run later; the CPU copier's fence is done already).
  try {
    mover_.copier().record(stream)->wait();
  } catch (const Error& e) {
    // The device failed: counted. A late read of the freed slot could only reach blocks past
    // the hit, which the engine does not read as cached.
    note_error(e.what());
  }
  for (std::size_t i = good; i < matched.size(); ++i) pages_.unpin(matched[i]);
  if (matched[good]->refs == 0) pages_.erase(matched[good]);
  matched.resize(good);
  return good;
}

std::shared_ptr<Fence> HostPrefixCache::enqueue_load(std::span<const PageMove> moves,
                                                     const StateBuffers* state_out,
                                                     std::byte* state_slot, StreamHandle stream,
                                                     LayerwiseLoad* layerwise) {
  Copier& copier = mover_.copier();
  if (state_out) copy_state(copier, Direction::kToDevice, *state_out, state_slot, stream);
  if (layerwise == nullptr) {
    mover_.copy(Direction::kToDevice, moves, stream);
    return nullptr;
  }
  detail::LayerQueue::Plan plan;
  plan.copier = &copier;
  plan.layout = &mover_.layout();
  plan.moves.assign(moves.begin(), moves.end());
  plan.layer_starts = layer_starts_;
  plan.stream = stream;
  plan.ahead_bytes = config_.layer_issue_ahead_bytes;
  plan.on_error = [this](const std::string& what) { note_error(what); };
  auto queue = std::make_shared<detail::LayerQueue>(lock_, std::move(plan));
  queue->start();  // if it throws, the caller's fence after the call covers what was issued
  layerwise->queue_ = queue;
  return queue;
}

std::size_t HostPrefixCache::worth_loading(std::size_t h, std::int64_t prompt_tokens,
                                           bool layerwise, bool whole_or_nothing) {
  if (!config_.prefill_seconds) return h;
  const double rate = mover_.copier().load_bytes_per_s();
  if (!(rate > 0)) return h;  // nothing measured yet: serve the hit
  LoadCost cost;
  cost.block_tokens = config_.block_tokens;
  cost.prompt_tokens = prompt_tokens;
  cost.page_load_s = static_cast<double>(mover_.layout().page_bytes()) / rate;
  cost.layers = layerwise ? layer_starts_.size() - 1 : 1;
  cost.prefill = &config_.prefill_seconds;
  return pages_worth_loading(h, cost, whole_or_nothing);
}

std::int64_t HostPrefixCache::prefetch(std::span<const std::int32_t> prompt,
                                       std::optional<std::string_view> salt) {
  if (prompt.empty()) throw std::invalid_argument("prefetch: the prompt is empty");
  if (!link_ || config_.state_bytes > 0) return 0;
  const std::int64_t B = config_.block_tokens;
  const std::int64_t max_pages =
      std::max<std::int64_t>(0, static_cast<std::int64_t>(prompt.size()) - config_.keep_tokens) / B;
  const std::string_view chain_salt = salt.value_or(std::string_view(config_.salt));
  std::lock_guard<std::mutex> g(mu_);
  if (disabled_ || max_pages == 0) return 0;
  // What host memory has (pages being stored count: they are on their way): found by content;
  // the tier thread hashes the rest, and takes pages host memory has by key as it goes.
  std::vector<Entry*> matched;
  walk_by_content(pages_, prompt, static_cast<std::size_t>(B), static_cast<std::size_t>(max_pages),
                  find_root(chain_salt), matched, /*ready_only=*/false);
  if (static_cast<std::int64_t>(matched.size()) >= max_pages) return 0;
  std::vector<Key> keys;
  for (const Entry* e : matched) keys.push_back(e->key);
  const std::int64_t asked = max_pages - static_cast<std::int64_t>(matched.size());
  const bool queued = link_->prefetch({{prompt.begin(), prompt.end()},
                                       std::string(chain_salt),
                                       matched.size(),
                                       max_pages,
                                       config_.key_bits,
                                       std::move(keys)});
  return queued ? asked : 0;
}

// --- store -------------------------------------------------------------------------------------

std::int64_t HostPrefixCache::store(std::string_view request_id,
                                    std::span<const std::int32_t> tokens,
                                    std::span<const std::int64_t> block_ids, StreamHandle stream,
                                    const StateExportFn& state_export,
                                    std::optional<std::string_view> salt) {
  const std::int64_t B = config_.block_tokens;
  const auto n_full = static_cast<std::int64_t>(tokens.size()) / B;
  if (static_cast<std::int64_t>(block_ids.size()) < n_full) {
    throw std::invalid_argument("store: " + std::to_string(tokens.size()) + " tokens make " +
                                std::to_string(n_full) + " full blocks but only " +
                                std::to_string(block_ids.size()) + " block_ids were given");
  }
  mover_.layout().check_blocks(block_ids.first(static_cast<std::size_t>(n_full)), false,
                               "store: block_ids");
  const std::string_view chain_salt = salt.value_or(std::string_view(config_.salt));
  // The prompt's cached pages are found by content, as a lookup finds them (walk_by_content):
  // their keys are their entries'. The rest is hashed, admitted and copied in installments (the
  // cached pages and 16 more, then what the background thread hashed meanwhile, or as many
  // again as the store has so far where it hashes on its own), so the first copies run while
  // the rest of a long prompt is hashed: a 1024-page prompt's chain takes 0.5-1 ms, as
  // long as the copy of 1024 pages of ~64 KiB (on an H200, 1024-page stores of 0.5-1 MiB pages
  // went from 0.78-0.89 of one contiguous copy to 0.91-0.98). Under the lock: the chain's
  // cached pages, unpinned between walks, must stay where the walk found them, and the
  // admission policy's observe_more continues this store's observe.
  std::unique_lock<std::mutex> lock(mu_);
  retire_completed();
  note_request(request_id);
  if (disabled_) return 0;
  ++stats_.stores;
  const std::uint64_t root = n_full > 0 ? intern_root(chain_salt) : 0;
  StoreWalk w;  // w.chain: every page of the prompt's chain now in the index
  walk_by_content(pages_, tokens, static_cast<std::size_t>(B), static_cast<std::size_t>(n_full),
                  root, w.chain, /*ready_only=*/false);
  std::vector<Key> keys;
  keys.reserve(w.chain.size() + kFirstKeys);
  for (const Entry* e : w.chain) keys.push_back(e->key);
  detail::ChainHasher hasher(chain_salt, tokens, B, n_full, config_.key_bits);
  hasher.extend(
      keys, std::min<std::int64_t>(n_full, static_cast<std::int64_t>(keys.size()) + kFirstKeys));
  // The rest of a long prompt's chain is hashed on the background thread while this one walks
  // and copies the pages it has keys for (chain_hasher.hpp).
  detail::ChainAhead ahead(hasher, keys);
  admission_.observe(keys);

  // Transfers of this call stay open (never retired, so never published) until it returns; if
  // it throws (a state buffer of the wrong size, an exception from state_export), they are
  // discarded: a store that raises publishes nothing.
  std::vector<Transfer*> opened;
  auto close = [&](bool discard) {
    for (Transfer* t : opened) {
      t->open = false;
      t->discard = t->discard || discard;
    }
  };

  // A store that ends early (a page declined, no room) still shows the policy its whole prompt,
  // as one that observed it at once would have: a key's next sighting counts as its second.
  auto observe_rest = [&] {
    const std::size_t seen = keys.size();
    if (static_cast<std::int64_t>(seen) == n_full) return;
    ahead.extend(keys, n_full, n_full);
    admission_.observe_more(std::span<const Key>(keys).subspan(seen));
  };
  std::int64_t new_pages = 0;
  bool unpinned = false;  // stopped at a slot whose memory is not pinned yet
  for (;;) {              // one installment: walk its keys, enqueue its copies
    Transfer t;
    t.request = std::string(request_id);
    t.is_store = true;
    t.open = true;
    std::vector<PageMove> moves;
    walk_store(
        pages_, admission_, next_serial_, keys, root, StaleKeys::kReplace, w,
        [&](std::size_t i, const Entry* e) {
          return same_tokens(e->tokens, tokens.subspan(i * static_cast<std::size_t>(B),
                                                       static_cast<std::size_t>(B)));
        },
        [&](std::size_t i, Entry* e) {
          std::byte* host = host_slot(mover_.pool(), e->slot, unpinned);
          if (host == nullptr) return false;
          const auto page =
              tokens.subspan(i * static_cast<std::size_t>(B), static_cast<std::size_t>(B));
          e->tokens.assign(page.begin(), page.end());
          pages_.add_edge(e, detail::page_fingerprint(page));
          moves.push_back({block_ids[i], host});
          t.pages.push_back(e);
          if (link_) t.parents.push_back(i == 0 ? tier_salt_digest(chain_salt) : keys[i - 1]);
          return true;
        });
    if (mover_.copier().joins_runs(mover_.layout())) {  // slot_order.hpp
      detail::slots_in_block_order(moves, t.pages);
    }
    // Tier records need the pages' sums: the device writes them into slot_sums_ (by slot, so
    // once the slots are final), or else the copier sums the pages as it copies them.
    if (slot_sums_) {
      for (std::size_t i = 0; i < moves.size(); ++i) {
        moves[i].sum_at_fence = slot_sums_->sums + t.pages[i]->slot;
      }
    } else if (link_) {
      t.checksums.resize(moves.size());
      for (std::size_t i = 0; i < moves.size(); ++i) moves[i].checksum = &t.checksums[i];
    }
    if (!moves.empty()) {
      bool failed = false;
      try {
        mover_.copy(Direction::kToHost, moves, stream);
      } catch (const Error& err) {
        note_error(err.what());
        failed = true;
      }
      if (Transfer* r = register_transfer(std::move(t), stream, failed)) opened.push_back(r);
      if (failed) {  // earlier installments stand: their pages are the prompt's prefix
        observe_rest();
        close(false);
        return new_pages;
      }
      note_success();
      new_pages += static_cast<std::int64_t>(moves.size());
    }
    if (w.stop != StoreWalk::Stop::kEnd || static_cast<std::int64_t>(keys.size()) == n_full) break;
    const std::size_t seen = keys.size();
    ahead.extend(keys, static_cast<std::int64_t>(seen) + kFirstKeys,
                 std::min<std::int64_t>(n_full, 2 * static_cast<std::int64_t>(seen)));
    admission_.observe_more(std::span<const Key>(keys).subspan(seen));
  }
  observe_rest();
  bool skipped = w.stop != StoreWalk::Stop::kEnd && w.stop != StoreWalk::Stop::kDeclined;
  if (w.stop == StoreWalk::Stop::kCollision) ++stats_.collisions;  // another prefix owns the key
  if (w.stop == StoreWalk::Stop::kDeclined) {
    stats_.pages_declined += n_full - static_cast<std::int64_t>(w.stopped_at);
  }
  const std::vector<Entry*>& chain = w.chain;

  pages_.touch_chain(chain);

  if (config_.state_bytes > 0 && state_export) {
    // Serials, not pointers: store_state unlocks while the engine exports.
    std::vector<std::uint64_t> serials;
    serials.reserve(chain.size());
    for (Entry* e : chain) serials.push_back(e->serial);
    try {
      for (std::int64_t j = 0; j < config_.state_lookback; ++j) {
        const std::int64_t idx = n_full - 1 - state_boundary_distance(j);
        if (idx < 0) break;
        if (idx >= static_cast<std::int64_t>(serials.size())) continue;  // page not cached
        const auto u = static_cast<std::size_t>(idx);
        if (!store_state(request_id, keys[u], serials[u], (idx + 1) * B, stream, state_export, lock,
                         opened, unpinned)) {
          skipped = true;
        }
      }
    } catch (...) {
      close(true);
      throw;
    }
  }
  close(false);
  if (unpinned) {
    ++stats_.store_skips_unpinned;
  } else if (skipped) {
    ++stats_.store_skips;
  }
  return new_pages;
}

bool HostPrefixCache::store_state(std::string_view request_id, const Key& key,
                                  std::uint64_t page_serial, std::int64_t position,
                                  StreamHandle stream, const StateExportFn& state_export,
                                  std::unique_lock<std::mutex>& lock,
                                  std::vector<Transfer*>& opened, bool& unpinned) {
  if (Entry* s = states_.find(key); s != nullptr && s->parent_serial == page_serial) {
    states_.touch(s);
    return true;
  }
  std::optional<StateBuffers> buf;
  lock.unlock();
  try {
    buf = state_export(position);
  } catch (...) {
    lock.lock();
    throw;
  }
  lock.lock();
  if (!buf) return true;  // the engine's state ring no longer reaches this position
  try {
    check_state_buffers(*buf, state_parts_, mover_.layout().device(),
                        "state_export(" + std::to_string(position) + ")", "must return");
  } catch (const std::invalid_argument& e) {
    throw std::invalid_argument(std::string(e.what()) + "; nothing was stored");
  }
  if (disabled_) return true;
  if (Entry* s = states_.find(key); s != nullptr) {  // again: the lock was released
    if (s->parent_serial == page_serial) {
      states_.touch(s);
      return true;
    }
    if (s->refs != 0) return false;
    states_.erase(s);  // stale: belongs to a page that was evicted
  }
  Entry* e = states_.insert(key, next_serial_++, page_serial);
  if (e == nullptr) return false;
  std::byte* host = host_slot(*state_pool_, e->slot, unpinned);
  if (host == nullptr) {
    states_.unpin(e);
    states_.erase(e);
    return false;
  }
  Transfer t;
  t.request = std::string(request_id);
  t.is_store = true;
  t.open = true;
  t.states.push_back(e);
  bool failed = false;
  try {
    copy_state(mover_.copier(), Direction::kToHost, *buf, host, stream);
  } catch (const Error& err) {
    note_error(err.what());
    failed = true;
  }
  if (Transfer* r = register_transfer(std::move(t), stream, failed)) opened.push_back(r);
  if (failed) return false;
  note_success();
  return true;
}

// --- poll, forget, stats -----------------------------------------------------------------------

std::int64_t HostPrefixCache::poll() {
  std::lock_guard<std::mutex> g(mu_);
  return retire_completed();
}

void HostPrefixCache::forget(std::string_view request_id) {
  std::lock_guard<std::mutex> g(mu_);
  retire_completed();
  auto it = requests_.find(std::string(request_id));
  if (it == requests_.end()) {
    throw UnknownRequest("unknown request '" + std::string(request_id) +
                         "': never seen by try_resume/store, or already forgotten");
  }
  for (Transfer& t : transfers_) {
    if (t.is_store && t.request == request_id) t.discard = true;
  }
  requests_.erase(it);
}

CacheStats HostPrefixCache::stats() const {
  std::lock_guard<std::mutex> g(mu_);
  CacheStats s = stats_;
  s.pages_evicted = pages_.evictions();
  s.states_evicted = states_.evictions();
  s.transfers_in_flight = static_cast<std::int64_t>(transfers_.size());
  s.pages_used = pages_.size();
  s.pages_capacity = pages_.capacity();
  s.pages_busy = pages_.busy();
  s.states_used = states_.size();
  s.states_capacity = states_.capacity();
  s.states_busy = states_.busy();
  // The pools' memory: the least advanced pool speaks for both (stopped, then waiting, then
  // pinning, then on demand, then whole).
  auto order = [](HostPool::Pinning p) {
    switch (p) {
      case HostPool::Pinning::kStopped:
        return 0;
      case HostPool::Pinning::kWaitingForMemory:
        return 1;
      case HostPool::Pinning::kPinning:
        return 2;
      case HostPool::Pinning::kOnDemand:
        return 3;
      case HostPool::Pinning::kWhole:
        return 4;
    }
    return 4;
  };
  HostPool::Status pool = mover_.pool().status();
  if (state_pool_) {
    const HostPool::Status st = state_pool_->status();
    pool.allocated_bytes += st.allocated_bytes;
    pool.total_bytes =
        st.total_bytes > SIZE_MAX - pool.total_bytes ? SIZE_MAX : pool.total_bytes + st.total_bytes;
    if (order(st.pinning) < order(pool.pinning)) {
      pool.pinning = st.pinning;
      pool.note = st.note;
    } else if (pool.note.empty()) {
      pool.note = st.note;
    }
  }
  const auto clamp = [](std::size_t v) {
    return static_cast<std::int64_t>(std::min<std::size_t>(v, INT64_MAX));
  };
  s.host_bytes = clamp(pool.allocated_bytes);
  s.host_bytes_capacity = clamp(pool.total_bytes);
  s.pinning = HostPool::name(pool.pinning);
  s.pinning_note = pool.note;
  s.requests = static_cast<std::int64_t>(requests_.size());
  s.salts = static_cast<std::int64_t>(roots_.size());
  s.admitting_second_sightings_only = admission_.wants_second_sighting();
  s.load_bytes_per_s = mover_.copier().load_bytes_per_s();
  if (link_) link_->add_stats(s);
  return s;
}

std::string HostPrefixCache::tier_name(const Key& page_key) const {
  return link_ ? tier_value_name(tier_space_, page_key) : std::string();
}

bool HostPrefixCache::flush_tier(std::chrono::milliseconds timeout) {
  using Clock = std::chrono::steady_clock;
  const auto now = Clock::now();
  const auto deadline = timeout >= std::chrono::duration_cast<std::chrono::milliseconds>(
                                       Clock::time_point::max() - now)
                            ? Clock::time_point::max()
                            : now + timeout;
  // Stores still copying first: their pages reach the tier's queue once retired. Their fences
  // are polled, not waited on, so that the deadline holds.
  std::vector<std::shared_ptr<Fence>> copying;
  {
    std::lock_guard<std::mutex> g(mu_);
    for (const Transfer& t : transfers_) {
      if (t.is_store && !t.discard && t.fence) copying.push_back(t.fence);
    }
  }
  for (const auto& f : copying) {
    for (;;) {
      bool done = true;
      try {
        done = f->done();
      } catch (const Error&) {  // a failed copy: retire_completed counts it
      }
      if (done) break;
      if (Clock::now() >= deadline) return false;
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
  }
  poll();  // completed stores queue their pages
  return link_ ? link_->drain(deadline) : true;
}

std::vector<Key> HostPrefixCache::page_lru_order() const {
  std::lock_guard<std::mutex> g(mu_);
  std::vector<Key> out;
  for (const Entry* e : pages_.lru_order()) out.push_back(e->key);
  return out;
}

}  // namespace hicache
