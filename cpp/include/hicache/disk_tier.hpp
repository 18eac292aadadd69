#pragma once
// DiskTier: a Tier in a local directory, so the cache outlives the engine's process (an upgrade,
// a crash, a restart) and holds more than host memory does.
//
// Values (a page and its record, tier_record.hpp: the reader checks every field and the page's
// checksum, so a torn, damaged or foreign value is a miss) are appended to segment files of
// `segment_bytes`; an index in memory maps each name to its place. A full segment gets an index
// file beside it, so a restart rebuilds the index from those (and scans only the segment that
// was being written). The directory holds at most `capacity_bytes` of segments: the oldest
// segment goes first, and a value read from the older half of the directory is written again at
// the head, so pages in use stay (segment FIFO with a second chance on reads).
//
// Crash safety: values are appended, never overwritten in place, and found only through entries
// whose header checks out; a process killed while writing loses at most the values it was
// writing. Data reaches the disk as the operating system writes it back (no fsync): a power
// loss may lose recent values, never serve a wrong one (records are checked).
//
// One process writes a directory: it holds the directory's LOCK file (flock) while the tier
// lives, and a second DiskTier on the same directory, in this process or another, is refused
// with the holder's pid. Caches of one process share a directory by sharing one DiskTier object.
// A directory the process cannot write is opened read-only: its values are served, writes fail
// (counted).
//
// I/O: direct I/O (O_DIRECT) where the filesystem allows it (the host pool is the cache above
// it: the page cache would hold the same bytes twice), else buffered (tmpfs). Writes go in one
// sequential write a batch from one writer thread; reads of a batch run on `read_threads`
// threads. A value's whole 4 KiB blocks move straight between its host slot and the disk when the
// slot is aligned (a cache aligns its slots to value_alignment() where that costs little), else
// through an aligned buffer and a copy. Every failure (ENOSPC, EIO, a file deleted or truncated
// under it, a read-only filesystem) is a failed or missing value in the batch's results, counted in
// stats(); nothing is thrown into the engine's calls.

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "hicache/tier.hpp"

namespace hicache {

struct DiskTierOptions {
  /// The directory (created if absent, with its parents).
  std::string path;
  /// Bytes of segment files the directory may hold.
  std::int64_t capacity_bytes = 0;
  /// Bytes of one segment file; 0: capacity/16, within [4 MiB, 256 MiB] (at most capacity/2).
  std::int64_t segment_bytes = 0;
  /// "auto" (direct where the filesystem allows it), "on" (refuse a filesystem that does not)
  /// or "off".
  std::string direct_io = "auto";
  /// Threads that read a batch's values.
  int read_threads = 8;
  /// @throws std::invalid_argument naming the bad field.
  void validate() const;
};

/// What a DiskTier holds and did (operators, tests).
struct DiskTierStats {
  std::int64_t values = 0;            ///< names the index holds
  std::int64_t bytes_on_disk = 0;     ///< segment files' bytes
  std::int64_t segments = 0;          ///< segment files
  std::int64_t values_written = 0;    ///< values appended (puts and rewrites of values read)
  std::int64_t values_rewritten = 0;  ///< of those, values read from the older half, moved up
  std::int64_t values_read = 0;
  /// Values moved straight between host memory and the disk by direct I/O, without a copy
  /// through an aligned buffer (the host slot was aligned: value_alignment()).
  std::int64_t values_written_direct = 0;
  std::int64_t values_read_direct = 0;
  std::int64_t segments_evicted = 0;  ///< oldest segments removed for room
  std::int64_t write_failures = 0;    ///< values not written (full disk, I/O error, read-only)
  std::int64_t read_failures = 0;     ///< values found in the index but not readable
  std::int64_t damaged_entries = 0;   ///< entries whose header did not check out (skipped)
  double index_rebuild_s = 0;         ///< what opening the directory took
  std::int64_t index_files_used = 0;  ///< segments whose index file was read at opening
  std::int64_t segments_scanned = 0;  ///< segments scanned at opening (no valid index file)
  bool direct_io = false;
  bool read_only = false;
  std::string last_error;
};

class DiskTier final : public Tier {
 public:
  /// Opens (or creates) the directory and rebuilds the index.
  /// @throws std::invalid_argument for bad options; hicache::Error if another DiskTier holds the
  ///         directory, if it holds another format, or if it cannot be opened at all.
  explicit DiskTier(DiskTierOptions options);
  /// Finishes the batches in flight, then closes the files (the LOCK is released).
  ~DiskTier() override;
  DiskTier(const DiskTier&) = delete;
  DiskTier& operator=(const DiskTier&) = delete;

  std::string name() const override { return "disk"; }
  std::int64_t put(std::span<const std::string> names, std::span<const std::byte* const> values,
                   std::span<const std::size_t> sizes) override;
  std::int64_t get(std::span<const std::string> names, std::span<std::byte* const> dests,
                   std::size_t capacity) override;
  std::int64_t exists(std::span<const std::string> names) override;
  std::optional<std::vector<std::int64_t>> poll(std::int64_t batch) override;
  bool wait(std::int64_t batch, std::chrono::microseconds timeout) override;
  /// Three gets in flight behind the one being checked: the disk never waits for the cache.
  std::size_t gets_in_flight() const override { return 3; }
  /// With direct I/O, 4096: a value in memory aligned so goes straight between it and the disk.
  std::size_t value_alignment() const override;

  DiskTierStats stats() const;
  const DiskTierOptions& options() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace hicache
