#pragma once
// TierLink: how a HostPrefixCache talks to its Tier. Writes pages the cache stored (off the
// engine's thread, through a bounded queue: a full queue drops the pages, counted), fetches the
// rest of a prefix on a host miss (on the caller's thread with a deadline, or in the background
// for the next prompt), and checks every fetched value's record against the reader's own keys
// and tokens (tier_record.hpp) before anything is published; the page's bytes are checked
// against the recorded checksum where they landed (caches that load layer by layer), or by their
// first load (check_on_load: the CPU copier sums them as it copies them, others' loads sum them
// while the copy runs). Values go to the tier straight from host slots (the
// record written after the page) and come back into host slots taken for them; the tier is told
// about the pool's memory (Tier::use_memory), so a backend can move them without copies.
// Internal to the cache.

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <new>
#include <optional>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "hicache/cache_stats.hpp"
#include "hicache/host_pool.hpp"
#include "hicache/prefix_index.hpp"
#include "hicache/tier.hpp"
#include "hicache/tier_record.hpp"

namespace hicache {

/// A tier and the lock that keeps its calls one at a time (Tier's rule), shared by the TierLink
/// and the page pool's memory (tier_memory) of every cache that uses the same backend object.
struct TierGate {
  /// The gate of `tier`: one per backend object while any cache uses it, so that its calls are
  /// one at a time however many caches share it (a process's caches share one MooncakeTier).
  static std::shared_ptr<TierGate> of(const std::shared_ptr<Tier>& tier);
  explicit TierGate(std::shared_ptr<Tier> t) : tier(std::move(t)) {}
  std::shared_ptr<Tier> tier;
  std::mutex mu;
  // use_memory refusals, by any cache using the backend (the memory is used all the same; puts
  // from it then fail), under errors_mu: stats() reads them without waiting for a backend call.
  std::mutex errors_mu;
  std::int64_t memory_errors = 0;
  std::string memory_error;
};

/// Memory from `inner` that the gate's tier is told about (Tier::use_memory) once allocated, and
/// before it is freed (release_memory).
std::shared_ptr<HostAllocator> tier_memory(std::shared_ptr<HostAllocator> inner,
                                           std::shared_ptr<TierGate> gate);

class TierLink {
 public:
  using Clock = std::chrono::steady_clock;

  struct PutPage {
    Entry* entry = nullptr;  ///< pinned by the cache until released
    Key key;
    Key parent;                            ///< previous page's key, or the salt's digest for page 0
    std::span<const std::int32_t> tokens;  ///< the entry's own: valid while it is pinned
    std::byte* slot = nullptr;             ///< the page, then room for its record (the value put)
    std::optional<std::uint64_t> checksum;  ///< the page's, if the store's copy summed it
  };
  /// What a fetch asks of the cache: the prompt's keys, its tokens and its salt.
  struct FetchSpec {
    std::span<const Key> keys;
    std::span<const std::int32_t> prompt;
    std::string_view salt;
  };
  /// A page of a fetch round: a host slot (the page, then room for its record) whose entry the
  /// cache inserted pending (not ready) for the value to land in, or the entry host memory had
  /// for that page already (not fetched).
  struct Slot {
    Entry* entry = nullptr;  ///< pinned until published
    std::byte* bytes = nullptr;
    bool fetch = false;  ///< inserted pending by reserve (else host memory had the page)
    /// Set by the fetch when it leaves the page's bytes to be checked as they are first loaded
    /// (check_on_load): the checksum its record gave.
    std::optional<std::uint64_t> unchecked;
  };
  /// A background fetch: pages [from, max_pages) of a prompt under a salt. The tier thread
  /// hashes the keys (off the engine's thread) before it fetches.
  struct FetchJob {
    std::vector<std::int32_t> prompt;
    std::string salt;
    std::size_t from = 0;
    std::int64_t max_pages = 0;
    int key_bits = 128;
    std::vector<Key> keys;  // the lookup's first keys; the tier thread adds the rest
  };
  /// The cache's side; each call takes the cache's lock.
  struct Host {
    /// Unpins entries once their values were put.
    std::function<void(const std::vector<Entry*>&)> release;
    /// Slots for pages [from, from + n) of a fetch, every entry pinned: the chain before them
    /// is the cached prefix, then `pending` (the previous round's, not yet published). Fewer
    /// (none) where a page cannot be placed; the fetch ends there.
    std::function<std::vector<Slot>(const FetchSpec&, std::size_t from, std::size_t n,
                                    std::span<const Slot> pending)>
        reserve;
    /// Publishes a round: the first `good` of its fetched pages become ready, the later ones
    /// are erased, every entry is unpinned. Returns how many of the round's pages are in host
    /// memory now, from its first on. With good = 0 it drops a round (its gets completed).
    std::function<std::size_t(std::span<const Slot> round, std::size_t good)> publish;
  };

  /// @param check_on_load fetched pages are checked against their records, and their bytes
  ///        against the recorded checksum only when they are first loaded (by the cache's
  ///        load, Slot::unchecked); false: their bytes are checked here, before they are
  ///        published.
  TierLink(std::shared_ptr<TierGate> gate, TierOptions options, Key space, std::size_t page_bytes,
           std::int64_t block_tokens, bool check_on_load, Host host);
  /// Writes what is queued, waits for batches in flight, stops the thread.
  ~TierLink();
  TierLink(const TierLink&) = delete;
  TierLink& operator=(const TierLink&) = delete;

  /// Queues pages to write. false if the queue has no room for them (nothing queued: the caller
  /// unpins them; counted as dropped).
  bool offer(std::vector<PutPage>& pages);
  /// While held (hold_offers(true) until hold_offers(false)), the tier thread takes no write:
  /// pages offered meanwhile go as one write once released (the stores retired in one pass).
  void hold_offers(bool hold);
  /// Fetches spec.keys[from..) into host memory (Host::reserve, then publish) in rounds, one in
  /// flight, until a page is missing or wrong, the deadline passes or the keys end.
  void fetch_into(const FetchSpec& spec, std::size_t from, Clock::time_point deadline);
  /// Fetches in the background (fetch_into, off the caller's thread). false if the queue is
  /// full.
  bool prefetch(FetchJob job);
  /// Waits until the queue is empty and nothing is in flight, or `deadline` passed (then
  /// false).
  bool drain(Clock::time_point deadline = Clock::time_point::max());

  /// A fetched page whose bytes did not match their checksum when first loaded (a miss there).
  void note_rejected(const std::string& why);

  /// Adds the tier's counters to `s`.
  void add_stats(CacheStats& s) const;

 private:
  struct Job {
    std::vector<PutPage> puts;
    std::optional<FetchJob> fetch;
  };
  void run();
  void write(std::vector<PutPage>& pages);
  void prefetch_now(FetchJob& job);
  // How a put or get of `pages` splits into rounds of at most `most`: as few as that allows,
  // sizes differing by at most one, never a lone small round beside a full one (64 pages of
  // 1 MiB went as 63 + 1 when a round held 64 MiB of values, a page and its record each).
  // Splitting 64 pages into two rounds so that the first one's checks overlap the second's
  // transfer measured worse on an H200 host (the two gets at once took 10.8 ms, one 8.3 ms).
  // Where the tier thread checks every page of a get on arrival, an edge round of 1/kEdgeShare
  // of a full one (of kEdgeShare pages or more) goes last: only that much is checked after the
  // last get, the rest while it crosses (one get in flight at a time still), at the cost of one
  // more batch. Measured on an H200 host beside no edge round: a prefetch of 64 x 1 MiB 0.93
  // against 0.83 of the raw client's get, of 32 x 8 MiB 0.92 against 0.79. A put has none: its
  // batch cost more than the sum it overlapped (tier_link.cpp, write).
  enum class Edge { kNone, kLast };
  static constexpr std::size_t kEdgeShare = 8;
  static std::vector<std::size_t> plan_rounds(std::size_t pages, std::size_t most, Edge edge);
  // Polls a batch until it completed, or until `deadline` (then nullopt).
  std::optional<std::vector<std::int64_t>> wait(std::int64_t batch, Clock::time_point deadline);
  // Abandons the late gets that completed (get_mu_ held); true if none is left.
  bool settle();
  // One round of a fetch: slots reserved, got, checked in place and published. Returns how
  // many of its pages are in host memory now, and whether every one asked for is (the fetch
  // goes on only then). `next` submits the next round once this one's get completed.
  struct Round {
    std::size_t from = 0, asked = 0;
    std::vector<Slot> slots;
    std::int64_t batch = -1;  // -1: nothing to get (host memory has every page)
  };
  std::optional<Round> submit_round(const FetchSpec& spec, std::size_t from, std::size_t n,
                                    std::span<const Slot> pending);
  bool land_round(const FetchSpec& spec, Round& round, Clock::time_point deadline,
                  const std::function<void()>& next);
  // A round started but not wanted (the one before it fell short): dropped once its get ended.
  void drop_round(Round& round, Clock::time_point deadline);
  void note_error(const std::string& what);

  std::shared_ptr<TierGate> gate_;
  Tier* tier_;           // gate_'s
  std::mutex& tier_mu_;  // gate_'s: one call into the backend at a time
  TierOptions options_;
  Key space_;
  std::size_t page_bytes_;
  std::int64_t block_tokens_;
  std::size_t value_bytes_;
  std::size_t round_pages_;  // values one round of a put or a get moves
  bool check_on_load_;
  Host host_;

  std::mutex get_mu_;  // one fetch at a time (two gets at once were slower than in turn)
  struct LateGet {
    std::int64_t batch;
    std::vector<Slot> slots;  // pending: their slots may still be written
  };
  std::vector<LateGet> late_gets_;  // gets given up on, under get_mu_

  mutable std::mutex mu_;
  std::condition_variable wake_, idle_;
  std::deque<Job> jobs_;
  std::int64_t queued_pages_ = 0;
  bool busy_ = false;
  bool stop_ = false;
  int holds_ = 0;
  CacheStats counters_;  // only the tier_* fields
  std::thread worker_;
};

}  // namespace hicache
