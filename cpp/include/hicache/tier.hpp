#pragma once
// Tier: a store behind the host pool that several engine processes, on several hosts, share
// (Mooncake Store; an in-memory one for tests). hicache writes pages it has stored to the tier
// and, when a prompt misses in host memory, fetches the rest of its prefix from the tier into
// host slots before it loads them like any host page.
//
// A backend moves opaque values by name, in batches, asynchronously: each call starts a batch
// and returns its id; poll() reports its results once it completed, as a copier's fence does.
// Backends may be C++ or Python (the nanobind module has a trampoline), and are called from
// hicache's tier threads and from the engine's threads, never two calls at once (except wait),
// however many caches share the backend object.
//
// What hicache puts in a value is a record (tier_record.hpp) that lets the reader check the
// page as exactly as a host page: a missing, stale, truncated or foreign value is a miss.

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

namespace hicache {

class Tier {
 public:
  /// Per-name results below zero.
  static constexpr std::int64_t kMissing = -1;  ///< no such value (get), or put refused
  static constexpr std::int64_t kFailed = -2;   ///< the backend failed (connection, server)

  virtual ~Tier() = default;
  virtual std::string name() const = 0;

  /// Starts writing values[i] (sizes[i] bytes, readable until the batch completed) under
  /// names[i]. Results: bytes written, or below zero.
  virtual std::int64_t put(std::span<const std::string> names,
                           std::span<const std::byte* const> values,
                           std::span<const std::size_t> sizes) = 0;
  /// Starts reading names[i] into dests[i] (`capacity` bytes each, writable until the batch
  /// completed). Results: bytes read (a value larger than `capacity` is a failure), or below
  /// zero.
  virtual std::int64_t get(std::span<const std::string> names, std::span<std::byte* const> dests,
                           std::size_t capacity) = 0;
  /// Starts checking which names exist. Results: 1 or 0, or below zero.
  virtual std::int64_t exists(std::span<const std::string> names) = 0;
  /// The batch's results (one per name) once it completed, after which the id is forgotten;
  /// nullopt while it runs. Non-blocking.
  virtual std::optional<std::vector<std::int64_t>> poll(std::int64_t batch) = 0;
  /// Blocks until `batch` completed or `timeout` passed, then returns true (poll then gives the
  /// results); false if this backend cannot block (the default), and hicache polls it with
  /// pauses of up to 100 us instead. Unlike the other calls it may run while another thread
  /// calls the backend. A backend whose poll is costly should block: polled ~3000 times a
  /// second, the Python Mooncake backend's own put of 64 MiB ran 22 % slower on a 2-core host
  /// (each poll takes the GIL and a share of a core from the client's transfer threads).
  virtual bool wait(std::int64_t /*batch*/, std::chrono::microseconds /*timeout*/) { return false; }
  /// Called for each region of host memory that values are put from or got into, before any
  /// put or get uses it: the host pool's memory, chunk by chunk as the pool grows (values go to
  /// and come from host slots directly: each slot has room for its page's record after the
  /// page). A backend that moves data without copies (Mooncake Store's batch_upsert_from /
  /// batch_get_into) registers them here. May be called from the pool's background thread,
  /// never beside another call.
  virtual void use_memory(std::span<std::byte> /*region*/) {}
  /// Called once the cache is done with a region use_memory named (no batch uses it any more).
  virtual void release_memory(std::span<std::byte> /*region*/) {}
  /// Gets a fetch keeps in flight behind the one it is checking. 1 (the default) suits a store
  /// whose client moves two batches at once slower than one after the other (Mooncake's); a
  /// disk, which idles between requests, wants more.
  virtual std::size_t gets_in_flight() const { return 1; }
  /// Values put from and got into memory aligned to this many bytes move without a copy (a
  /// disk's direct I/O: 4096); 0 (the default): any address is as good. A cache aligns its host
  /// slots to it where that adds at most 1/64 to a slot (pages of 256 KiB and more).
  virtual std::size_t value_alignment() const { return 0; }
};

/// How a host miss uses the tier (CacheConfig::tier). Pages reach the tier when the host stores
/// them (write-through), so a cache with a tier should admit every page (Admission::kAlways):
/// measured on the Mooncake conversation trace, 4 instances of 1M tokens over a 30M tier,
/// round-robin, that serves 0.366 of prompt tokens against 0.287 with adaptive admission.
struct TierOptions {
  /// A host miss asks the tier for the rest of the prefix and waits at most this long for it
  /// (then serves what host memory had). 0: never waits; the fetch runs in the background and
  /// the pages serve the next prompt that needs them (prefetch).
  std::int64_t wait_us = 50000;
  /// Pages waiting to be written to the tier; a store beyond that is dropped (counted).
  std::int64_t queue_pages = 4096;
  /// Pages a put or a get moves in one batch at most, in bytes (at least one page): each batch
  /// costs the store a fixed time of its own, so a round is as large as this allows. Gets of a
  /// cache that loads layer by layer, whose pages are checked as they arrive, move half of it
  /// at a time, one batch crossing while the one before it is checked. Values go straight from
  /// and into host slots.
  std::int64_t buffer_bytes = std::int64_t{128} << 20;
  /// Names the model and its KV format in every value's name and record, so caches of other
  /// models or versions sharing the store never read each other's pages. Give each model
  /// (and each quantization, each tensor-parallel rank) its own.
  std::string space = "default";
  /// @throws std::invalid_argument naming the bad field.
  void validate() const;
};

}  // namespace hicache
