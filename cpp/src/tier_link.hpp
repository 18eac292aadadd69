#pragma once
// TierLink: how a HostPrefixCache talks to its Tier. Writes pages the cache stored (off the
// engine's thread, through a bounded queue: a full queue drops the pages, counted), fetches the
// rest of a prefix on a host miss (on the caller's thread with a deadline, or in the background
// for the next prompt), and checks every fetched value's record against the reader's own keys
// and tokens (tier_record.hpp) before anything is handed back; the page's checksum is checked
// by whoever copies it out (copy_tier_page), in the same pass as the copy. Values go through two
// buffers allocated once (Tier::use_buffers), so a backend can move them without copies. Internal
// to the cache.

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
#include "hicache/prefix_index.hpp"
#include "hicache/tier.hpp"
#include "hicache/tier_record.hpp"

namespace hicache {

class TierLink {
 public:
  using Clock = std::chrono::steady_clock;

  struct PutPage {
    Entry* entry = nullptr;  ///< pinned by the cache until released
    Key key;
    Key parent;                            ///< previous page's key, or the salt's digest for page 0
    std::span<const std::int32_t> tokens;  ///< the entry's own: valid while it is pinned
    const std::byte* page = nullptr;
  };
  /// A run of pages whose records matched, in prompt order: views into the get buffer, valid
  /// until the fetch's next call. Each page must go through copy_tier_page (and count a
  /// failure with note_rejected) before it is used.
  struct Run {
    std::size_t from = 0;  ///< index of the first page's key
    std::vector<TierPage> pages;
    bool complete = false;  ///< every page asked for arrived and was exact (more may follow)
  };
  class Fetch;
  /// A background fetch: pages [from, max_pages) of a prompt under a salt. The tier thread
  /// hashes the keys (off the engine's thread) before it fetches.
  struct FetchJob {
    std::vector<std::int32_t> prompt;
    std::string salt;
    std::size_t from = 0;
    std::int64_t max_pages = 0;
    int key_bits = 128;
    std::vector<Key> keys;  // filled by the tier thread
  };
  /// Unpins entries whose bytes were copied out (takes the cache's lock).
  using Release = std::function<void(const std::vector<Entry*>&)>;
  /// Inserts pages of a background fetch for job.keys[from..] (takes the cache's lock); returns
  /// how many it put in host memory.
  using Adopt =
      std::function<std::size_t(const FetchJob&, std::size_t from, std::span<const TierPage>)>;

  TierLink(std::shared_ptr<Tier> tier, TierOptions options, Key space, std::size_t page_bytes,
           std::int64_t block_tokens, Release release, Adopt adopt);
  /// Writes what is queued, waits for batches in flight, stops the thread.
  ~TierLink();
  TierLink(const TierLink&) = delete;
  TierLink& operator=(const TierLink&) = delete;

  /// Queues pages to write. false if the queue has no room for them (nothing queued: the caller
  /// unpins them; counted as dropped).
  bool offer(std::vector<PutPage>& pages);
  /// Starts fetching keys[from..) for `prompt` under `salt` (see Fetch).
  Fetch fetch(std::span<const Key> keys, std::span<const std::int32_t> prompt,
              std::string_view salt, std::size_t from, Clock::time_point deadline);
  /// Hands a fetch's runs to `take` (which returns how many of a run's pages it kept) until one
  /// is not kept whole or the fetch is over.
  using Take = std::function<std::size_t(std::size_t from, std::span<const TierPage> pages)>;
  void fetch_into(std::span<const Key> keys, std::span<const std::int32_t> prompt,
                  std::string_view salt, std::size_t from, Clock::time_point deadline,
                  const Take& take);
  /// Fetches in the background and hands the pages to `adopt`. false if the queue is full.
  bool prefetch(FetchJob job);
  /// Waits until the queue is empty and nothing is in flight (tests, shutdown).
  void drain();

  /// A fetched page whose bytes did not match their checksum when copied out (a miss there).
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
  // How a put or get of `pages` splits into rounds of at most round_pages_: as few as that
  // allows, sizes differing by at most one, never a lone small round beside a full one (64 pages
  // of 1 MiB went as 63 + 1 when a round held 64 MiB of values, a page and its record each).
  // Splitting 64 pages into two rounds so that the first one's checks overlap the second's
  // transfer measured worse on an H200 host (the two gets at once took 10.8 ms, one 8.3 ms).
  struct Rounds {
    Rounds(std::size_t pages, std::size_t most);
    std::size_t size(std::size_t r) const { return base + (r < extra ? 1 : 0); }
    std::size_t count, base, extra;
  };
  Rounds rounds(std::size_t pages) const;
  // Polls a batch until it completed, or until `deadline` (then nullopt: the batch is
  // remembered in `pending` and the buffer it uses is not reused before it completed).
  std::optional<std::vector<std::int64_t>> wait(std::int64_t batch, Clock::time_point deadline);
  // Drops from `batches` those that completed; true if none is left.
  bool settle(std::vector<std::int64_t>& batches);
  void note_error(const std::string& what);

  std::shared_ptr<Tier> tier_;
  TierOptions options_;
  Key space_;
  std::size_t page_bytes_;
  std::int64_t block_tokens_;
  std::size_t value_bytes_;
  std::size_t round_pages_;  // values one round of a put or a get moves (half a buffer)
  Release release_;
  Adopt adopt_;

  std::mutex tier_mu_;  // one call into the backend at a time
  // Not zeroed: memory is touched only as values pass through (a cache that never fetches
  // costs no get buffer).
  // Page-aligned, so that values (records padded to 64 bytes, then the page) are aligned and
  // copies into them can use streaming stores (page_checksum.hpp); new[] gives 16 bytes.
  struct AlignedFree {
    void operator()(std::byte* p) const { ::operator delete[](p, std::align_val_t{4096}); }
  };
  using Buffer = std::unique_ptr<std::byte[], AlignedFree>;
  static Buffer buffer(std::size_t bytes) {
    return Buffer(new (std::align_val_t{4096}) std::byte[bytes]);
  }
  Buffer put_buffer_;  // the tier thread's
  std::mutex get_mu_;  // the get buffer belongs to one fetch at a time
  Buffer get_buffer_;
  std::vector<std::int64_t> late_gets_;  // gets given up on, maybe still writing the buffer

  mutable std::mutex mu_;
  std::condition_variable wake_, idle_;
  std::deque<Job> jobs_;
  std::int64_t queued_pages_ = 0;
  bool busy_ = false;
  bool stop_ = false;
  CacheStats counters_;  // only the tier_* fields
  std::thread worker_;
};

/// One fetch in rounds of half the get buffer, one in flight: the next round crosses the
/// network while the caller checks and adopts this one. Holds the get buffer until
/// destroyed; rounds still in flight then are left to complete (the buffer is not reused before).
class TierLink::Fetch {
 public:
  /// The next verified run (empty when the fetch is over: a page missing or wrong, the
  /// deadline, the end of the keys).
  Run next();
  Fetch(Fetch&&) = default;
  ~Fetch();

 private:
  friend class TierLink;
  struct Round {
    std::size_t first, n, ring;
    std::int64_t batch;
  };
  Fetch(TierLink& link, std::span<const Key> keys, std::span<const std::int32_t> prompt,
        std::string_view salt, std::size_t from, Clock::time_point deadline);
  void submit();

  TierLink* link_;
  std::unique_lock<std::mutex> hold_;
  std::span<const Key> keys_;
  std::span<const std::int32_t> prompt_;
  Key root_;
  std::size_t next_;
  Rounds plan_;
  Clock::time_point deadline_;
  std::deque<Round> rounds_;
  std::size_t ring_ = 0;
  bool over_ = false;
};

}  // namespace hicache
