#pragma once
// The two walks over a prompt's chain of page keys that every front end of the index shares:
// HostPrefixCache (try_resume, store), BlockCatalog (the split API's index half) and the replay
// driver. One definition, so the one-call cache, the split halves and `hicache replay` make the
// same decisions: which cached prefix a prompt hits, which new pages the admission policy lets
// in, which idle page leaf-first eviction gives up, and where a store stops.
//
// Callers hold whatever lock guards the index. Hooks let each front end add its own checks:
// HostPrefixCache compares a page's tokens and places each new page in host memory that may not
// be pinned yet; the catalog and the replay trust their keys.

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <vector>

#include "hicache/admission_policy.hpp"
#include "hicache/key.hpp"
#include "hicache/prefix_index.hpp"

namespace hicache {

/// Keys whose table slots are prefetched ahead of a walk (a lookup's cost is its cache misses).
inline constexpr std::size_t kWalkPrefetch = 8;

/// Appends to `chain` the longest run of ready entries that continues it along keys[chain.size()
/// ..limit), each stored under its predecessor (the first under `root`) and accepted by
/// `same(i, entry)` (the page's content matches key i's). Returns chain.size().
template <class Same>
std::size_t walk_cached(PrefixIndex& index, std::span<const Key> keys, std::size_t limit,
                        std::uint64_t root, std::vector<Entry*>& chain, Same&& same) {
  std::uint64_t parent = chain.empty() ? root : chain.back()->serial;
  for (std::size_t i = chain.size(); i < limit; ++i) {
    if (i + kWalkPrefetch < limit) index.prefetch(keys[i + kWalkPrefetch]);
    Entry* e = index.find(keys[i]);
    if (e == nullptr || !e->ready || e->parent_serial != parent || !same(i, e)) break;
    chain.push_back(e);
    parent = e->serial;
  }
  return chain.size();
}

/// The outcome of walk_store.
struct StoreWalk {
  enum class Stop {
    kEnd,        ///< every key is cached or pending now
    kDeclined,   ///< the admission policy declined key `stopped_at`
    kNoRoom,     ///< every slot is held
    kCollision,  ///< another prefix's page holds key `stopped_at` (same() was false)
    kBusy,       ///< a stale entry for key `stopped_at` is held by a transfer
    kRefused,    ///< the `placed` hook refused the new entry (e.g. its memory is not there yet)
  };
  std::vector<Entry*>
      chain;  ///< the chain's pages in the index, in order (input: a verified prefix)
  std::vector<Entry*> fresh;  ///< inserted by this walk: pending (one reference, not ready)
  std::vector<Key> evicted;   ///< pages evicted to make room
  Stop stop = Stop::kEnd;
  std::size_t stopped_at = 0;
};

/// How a walk treats a cached key stored under another parent than the chain's.
enum class StaleKeys {
  /// Keys hash their own content only (HostPrefixCache, the replay): such an entry belongs to
  /// a prefix that was evicted and re-stored, so the page is stored again in its place.
  kReplace,
  /// Keys name their whole prefix (vLLM's chained block hashes): a cached key is the page,
  /// whatever parent it was stored under.
  kTrust,
};

/// Extends `w.chain` (a prefix of keys already verified, e.g. by walk_cached) to every key: a key
/// cached under the chain's last page is kept; any other is admitted by `admission` (told
/// whether the index is full), inserted with a fresh serial (evicting an idle page if needed)
/// and handed to `placed(i, entry)`, which may refuse it (it is then erased). The first key that
/// cannot be stored ends the walk: its descendants would be unreachable. Cached pages of the
/// chain stay pinned during the walk so that an insert never evicts the chain's own pages. The
/// caller marks the chain used (PrefixIndex::touch_chain) once it commits to the store.
template <class Same, class Placed>
void walk_store(PrefixIndex& index, AdmissionPolicy& admission, std::uint64_t& next_serial,
                std::span<const Key> keys, std::uint64_t root, StaleKeys stale, StoreWalk& w,
                Same&& same, Placed&& placed) {
  const std::size_t n = keys.size();
  std::vector<Entry*> held(w.chain.begin(), w.chain.end());
  for (Entry* e : held) index.pin(e);
  std::uint64_t parent = w.chain.empty() ? root : w.chain.back()->serial;
  w.stop = StoreWalk::Stop::kEnd;
  for (std::size_t i = w.chain.size(); i < n; ++i) {
    if (i + kWalkPrefetch < n) index.prefetch(keys[i + kWalkPrefetch]);
    Entry* e = index.find(keys[i]);
    if (e != nullptr) {
      if (!same(i, e)) {
        w.stop = StoreWalk::Stop::kCollision;  // never overwrite another prefix's page
        w.stopped_at = i;
        break;
      }
      if (e->parent_serial == parent || stale == StaleKeys::kTrust) {
        index.pin(e);
        held.push_back(e);
        w.chain.push_back(e);
        parent = e->serial;
        continue;
      }
      if (e->refs != 0) {
        w.stop = StoreWalk::Stop::kBusy;
        w.stopped_at = i;
        break;
      }
    }
    // e, if any, is stale: it gives up its slot to the page stored again here.
    if (!admission.admit(i, index.full() && e == nullptr)) {
      w.stop = StoreWalk::Stop::kDeclined;
      w.stopped_at = i;
      break;
    }
    if (e != nullptr) index.erase(e);
    std::optional<Key> evicted;
    e = index.insert(keys[i], next_serial++, parent, &evicted);
    if (evicted) w.evicted.push_back(*evicted);
    if (e == nullptr) {
      w.stop = StoreWalk::Stop::kNoRoom;
      w.stopped_at = i;
      break;
    }
    if (!placed(i, e)) {
      index.unpin(e);
      index.erase(e);
      w.stop = StoreWalk::Stop::kRefused;
      w.stopped_at = i;
      break;
    }
    w.fresh.push_back(e);
    w.chain.push_back(e);
    parent = e->serial;
  }
  for (Entry* e : held) index.unpin(e);
}

}  // namespace hicache
