#pragma once
// HostPrefixCache: the policy. Write-through store of full prompt blocks (and hybrid-model
// states), exact prefix resume, LRU eviction of idle entries, transfers retired by poll().
//
// Threads: every public method may be called from several threads at once. Callbacks
// (allocate, state_export, CacheConfig::prefill_seconds) are called without the cache's lock
// held, so they may call the cache.

#include <chrono>
#include <cstdint>
#include <functional>
#include <list>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "hicache/admission_policy.hpp"
#include "hicache/block_catalog.hpp"
#include "hicache/cache_config.hpp"
#include "hicache/cache_stats.hpp"
#include "hicache/copier.hpp"
#include "hicache/host_pool.hpp"
#include "hicache/layerwise_load.hpp"
#include "hicache/page_layout.hpp"
#include "hicache/prefix_index.hpp"
#include "hicache/slot_mover.hpp"
#include "hicache/state_buffers.hpp"
#include "hicache/tier.hpp"
#include "hicache/tier_record.hpp"

namespace hicache {

class TierLink;
struct TierGate;

class HostPrefixCache {
 public:
  /// Given the number of tokens to load (a multiple of block_tokens), returns the engine block
  /// ids that receive them, one per page in prompt order, or nullopt to defer (no blocks now).
  using AllocateFn = std::function<std::optional<std::vector<std::int64_t>>(std::int64_t tokens)>;
  /// Given a position (a multiple of block_tokens), returns the buffers holding the engine's
  /// state at that position (one per CacheConfig::state_part_bytes(), on the segments' device),
  /// or nullopt if the engine can no longer produce it. They must stay valid until the copies
  /// enqueued on the stream ran.
  using StateExportFn = std::function<std::optional<StateBuffers>(std::int64_t position)>;

  /// @param segments the engine's KV tensors (see page_layout.hpp), all on `device`.
  /// @param copier nullptr picks the CPU copier for CPU segments.
  /// @param tier a store shared with other caches (see tier.hpp; CacheConfig::tier says how it
  ///        is used): pages this cache stores are written to it, and a host miss fetches the
  ///        rest of the prefix from it. Pages only: a cache with states does not fetch.
  /// @note CUDA segments: the first cache of a process loads hicache's kernels, and with CUDA's
  ///       lazy module loading (the default) that waits until work already running on the
  ///       device ends (a cache built beside a 2 s kernel took 2.02 s on an H200). Build it
  ///       before the engine's first long kernels, or accept that wait once.
  /// @throws std::invalid_argument for a bad layout or config, or segments the copier cannot
  ///         reach. Pinned pools (CUDA) pin their first chunk here and the rest in the
  ///         background (CacheConfig::pin_upfront); CPU pools allocate at first use.
  HostPrefixCache(std::vector<Segment> segments, Device device, CacheConfig config,
                  std::shared_ptr<Copier> copier = nullptr, std::shared_ptr<Tier> tier = nullptr);
  /// Waits for transfers still in flight, then frees the host pools.
  ~HostPrefixCache();
  HostPrefixCache(const HostPrefixCache&) = delete;
  HostPrefixCache& operator=(const HostPrefixCache&) = delete;

  /// Looks up the longest cached prefix of `prompt`, leaving at least keep_tokens to compute
  /// and, if the model has state, ending where a state is stored. On a hit, calls
  /// `allocate(tokens)`, then enqueues the copies into those blocks (and the state's parts into
  /// `state_out`'s buffers) on `stream`, so work the engine enqueues after it on that stream sees
  /// the data. The blocks and `state_out` must stay valid until the copies into them completed (in
  /// stream order on a GPU; poll() retires them).
  /// With `layerwise` (CacheConfig::layer_segments must be set), the pages' copies are enqueued
  /// layer group by layer group, each with a fence in *layerwise (the state's first, under layer
  /// 0's): the engine waits for layer i right before computing it (layerwise_load.hpp), so
  /// `stream` should be a copy stream of its own. With CacheConfig::prefill_seconds the hit is
  /// first cut to what is faster to load than to recompute (load_or_recompute.hpp).
  /// @return tokens served (a multiple of block_tokens; the engine prefills from there), 0 on a
  ///         miss or cache failure (counted; never thrown), -1 if allocate deferred.
  /// @throws std::invalid_argument for an empty prompt, a missing or wrong-sized state_out, an
  ///         allocate result of the wrong length or with duplicates, or `layerwise` without
  ///         layer_segments; std::out_of_range for a block id outside the pool. Nothing is
  ///         copied when it throws.
  std::int64_t try_resume(std::string_view request_id, std::span<const std::int32_t> prompt,
                          const AllocateFn& allocate, StreamHandle stream = nullptr,
                          std::optional<StateBuffers> state_out = std::nullopt,
                          std::optional<std::string_view> salt = std::nullopt,
                          LayerwiseLoad* layerwise = nullptr);

  /// Write-through after prefill: enqueues on `stream` the copy of every full block of `tokens`
  /// not yet cached that the admission policy admits (the first page it declines ends the store:
  /// counted in pages_declined) (block_ids[i] holds tokens [i*B, (i+1)*B)), then asks
  /// `state_export` for the state at each of state_lookback block boundaries (the last one and
  /// those 1, 2, 4, ... blocks before it) not yet
  /// cached and enqueues its copy before asking for the next (so the engine may return the same
  /// staging buffer each time). Best effort: stops when no slot can be freed, or at a slot whose
  /// host memory is not pinned yet (each counted). Entries become hit-able once poll() sees the
  /// copy complete.
  /// @return pages newly enqueued.
  /// @throws std::invalid_argument if block_ids is shorter than the full blocks of tokens (or
  ///         std::out_of_range for a bad block id): nothing is enqueued then. If a state buffer
  ///         is the wrong size or device (std::invalid_argument) or state_export throws, the
  ///         call raises and publishes nothing: copies it had enqueued into host slots are
  ///         discarded when they complete, never served.
  std::int64_t store(std::string_view request_id, std::span<const std::int32_t> tokens,
                     std::span<const std::int64_t> block_ids, StreamHandle stream = nullptr,
                     const StateExportFn& state_export = {},
                     std::optional<std::string_view> salt = std::nullopt);

  /// With a tier: starts fetching, in the background, the part of `prompt`'s prefix that host
  /// memory lacks, so that a try_resume of it later finds the pages in host memory and never
  /// waits for the tier (an engine calls this when a request arrives, before it schedules it).
  /// Pages only (a cache with states does not fetch). Never blocks on the tier.
  /// @return pages asked of the tier (0: host memory has the prefix, no tier, or its queue is
  ///         full). @throws std::invalid_argument for an empty prompt.
  std::int64_t prefetch(std::span<const std::int32_t> prompt,
                        std::optional<std::string_view> salt = std::nullopt);

  /// Retires completed transfers: stored entries become hit-able, loaded ones are released.
  /// Non-blocking. @return transfers retired.
  std::int64_t poll();

  /// The request finished or was aborted; its GPU blocks may be reused from now on. Stores of
  /// it that have not completed are discarded when they complete (never served), and their
  /// slots stay held until then. @throws hicache::UnknownRequest if the id is not known.
  void forget(std::string_view request_id);

  CacheStats stats() const;
  const PageLayout& layout() const { return mover_.layout(); }
  /// How pages move between the engine and host memory (Copier::path()).
  const char* copy_path() const { return mover_.copy_path(); }
  const CacheConfig& config() const { return config_; }

  /// Tests: keys of cached pages, least recently used first.
  std::vector<Key> page_lru_order() const;
  /// Waits until every page stored before the call has reached its end in the tier: written,
  /// failed or dropped (CacheStats::tier_pages_*). Stores whose copies are still running are
  /// waited for first (then retired, as by poll()). Without a tier it only retires.
  /// @note Blocks the caller; shutdown does the same without a timeout.
  /// @return false if `timeout` passed first (CacheStats::tier_pages_queued says how many
  ///         pages were still on their way).
  bool flush_tier(std::chrono::milliseconds timeout = std::chrono::milliseconds::max());
  /// The name a page's value has in the tier (operators, tests); empty without a tier.
  std::string tier_name(const Key& page_key) const;

 private:
  struct Transfer {
    std::string request;
    bool is_store = false;
    bool discard = false;  // store of a forgotten request, or one that raised: never published
    bool open = false;     // its store() call is still running: not retired yet
    std::chrono::steady_clock::time_point started = std::chrono::steady_clock::now();
    std::shared_ptr<Fence> fence;  // a layer-wise load's is its LayerQueue
    std::vector<Entry*> pages;
    std::vector<Entry*> states;
    std::vector<Key> parents;  // with a tier: each stored page's parent key (salt digest first)
    // With a tier: each stored page's checksum, where the copier summed it as it copied (CPU);
    // where the device sums stores (slot_sums_), that holds them instead.
    std::vector<std::optional<std::uint64_t>> checksums;
  };

  std::int64_t retire_completed();
  // How a load checks the pages it copies that were fetched from the tier and not checked yet.
  enum class UncheckedSums {
    kNone,         // it has none
    kCopier,       // the copier sums them as it copies them (the CPU copier)
    kDevice,       // the device sums them where they landed, after the copy (slot_sums_), and
                   // the call waits for that: only where the stream had nothing queued before
    kPageThreads,  // the page threads sum their host slots while the copy runs
  };
  UncheckedSums unchecked_sums(StreamHandle stream, bool layerwise);
  // kPageThreads: sums[i] for each matched[i] in `unchecked`, from its host slot (moves[i].host)
  // on the page threads, while the load just enqueued runs. Called unlocked.
  void sum_host_slots(std::span<const std::size_t> unchecked, std::span<const PageMove> moves,
                      std::span<std::optional<std::uint64_t>> sums) const;
  // After a load of pages fetched from the tier whose bytes were not checked yet (sums[i] for
  // each unchecked matched[i]): the pages before the first that failed are checked now; that
  // one is erased, once the load on `stream` has ended, and the hit ends before it. Returns the
  // pages kept.
  std::size_t check_loaded(std::vector<Entry*>& matched,
                           std::span<const std::optional<std::uint64_t>> sums, StreamHandle stream);
  void finish(Transfer& t);
  // With a tier: queues a completed store's pages for writing (pinned until copied out).
  void write_to_tier(Transfer& t);
  // The cache's side of its TierLink (host_prefix_cache.cpp): host slots for the pages a fetch
  // gets from the tier, linked to the chain the prompt has cached before them, published once
  // checked.
  struct TierSide;
  // The serial of salt's chain root, created if needed (stores only).
  std::uint64_t intern_root(std::string_view salt);
  // 0 if no root exists for salt: lookups never create one, so a miss costs no memory.
  std::uint64_t find_root(std::string_view salt) const;

  void note_request(std::string_view request_id);
  void note_error(const std::string& what);
  // The slot's address, or nullptr if its memory is not there: not pinned yet (sets `unpinned`)
  // or its allocation failed (counted as an error).
  std::byte* host_slot(HostPool& pool, std::int64_t slot, bool& unpinned);
  void note_success() { consecutive_errors_ = 0; }
  // Enqueues the load of `moves` (and the state) on `stream`, whole, or layer group by layer
  // group as `layerwise` asks for them (its first layers now). Returns what tells when the
  // load completes, or null if the copier's fence after the call does. @throws hicache::Error
  // as the copier does.
  std::shared_ptr<Fence> enqueue_load(std::span<const PageMove> moves,
                                      const StateBuffers* state_out, std::byte* state_slot,
                                      StreamHandle stream, LayerwiseLoad* layerwise);
  // The pages of an h-page hit worth loading (CacheConfig::prefill_seconds). Unlocked.
  std::size_t worth_loading(std::size_t h, std::int64_t prompt_tokens, bool layerwise,
                            bool whole_or_nothing);
  // Registers what was enqueued so far; if no fence can be recorded the entries stay held
  // forever (never reused while a copy might still touch them) and nullptr is returned.
  Transfer* register_transfer(Transfer t, StreamHandle stream, bool failed);
  // Adds the transfer it registers to `opened` (see store()).
  bool store_state(std::string_view request_id, const Key& key, std::uint64_t page_serial,
                   std::int64_t position, StreamHandle stream, const StateExportFn& state_export,
                   std::unique_lock<std::mutex>& lock, std::vector<Transfer*>& opened,
                   bool& unpinned);

  CacheConfig config_;
  std::vector<std::int64_t> state_parts_;  // bytes of each part of a state
  std::vector<std::size_t> layer_starts_;  // first segment of each layer group, and the end
  // With a tier: the tier and the lock that keeps its calls one at a time, shared by link_ and
  // the page pool's memory, which the tier is told about as it is allocated (before mover_).
  std::shared_ptr<TierGate> tier_gate_;
  // The copier half (the engine's segments, the page pool and the copier) and the index half
  // (pages, admission, eviction, serials) of the split API: try_resume and store are the
  // one-call form of their steps. The catalog's index is used under mu_ (entries carry tokens).
  SlotMover mover_;
  BlockCatalog catalog_;
  PrefixIndex& pages_ = catalog_.index();
  AdmissionPolicy& admission_ = catalog_.admission();  // pages only: states follow their pages
  std::uint64_t& next_serial_ = catalog_.next_serial();
  std::unique_ptr<HostPool> state_pool_;

  // Shared with layer-wise loads, which issue their later layers under it and may outlive the
  // cache (layer_queue.hpp).
  std::shared_ptr<std::mutex> lock_ = std::make_shared<std::mutex>();
  std::mutex& mu_ = *lock_;
  PrefixIndex states_;
  std::list<Transfer> transfers_;
  std::unordered_map<std::string, std::int64_t> requests_;  // id -> transfers in flight
  struct StringHash {
    using is_transparent = void;
    std::size_t operator()(std::string_view v) const { return std::hash<std::string_view>{}(v); }
  };
  // salt -> root serial, for salts that some page 0 uses (swept in intern_root)
  std::unordered_map<std::string, std::uint64_t, StringHash, std::equal_to<>> roots_;
  std::size_t roots_sweep_at_ = 64;
  std::int64_t consecutive_errors_ = 0;
  bool disabled_ = false;
  CacheStats stats_;
  std::unique_ptr<AdmissionPolicy> admit_all_;  // pages fetched from the tier are being used
  Key tier_space_{};
  // With a tier, where the copier sums stores on the device (Copier::sums_on_device): each host
  // slot's page checksum, which the device writes as it stores the page (the copier's pinned
  // memory), read when the store's pages are offered to the tier. Without it the tier thread
  // reads each page back from its slot to sum it before the put.
  struct SlotSums {
    std::shared_ptr<HostAllocator> memory;
    std::uint64_t* sums = nullptr;
    std::size_t bytes = 0;
    SlotSums(std::shared_ptr<HostAllocator> m, std::size_t slots);
    ~SlotSums();
    SlotSums(const SlotSums&) = delete;
    SlotSums& operator=(const SlotSums&) = delete;
  };
  std::unique_ptr<SlotSums> slot_sums_;
  std::unique_ptr<TierLink> link_;  // last: stopped first, while the pools still exist
};

}  // namespace hicache
