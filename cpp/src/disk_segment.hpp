#pragma once
// The disk tier's files (internal to disk_tier.cpp). A segment is a file of entries appended
// one after another, each aligned to kAlign so that direct I/O can read it alone. An entry of a
// value of V bytes puts the value's whole kAlign blocks (its head, V rounded down to kAlign) last,
// so that direct I/O moves them straight between a host slot and the disk, and the header with
// the rest of the value (its tail, under kAlign bytes) first, in a lead block:
//
//   [EntryHeader: 64 bytes][value[head, V)][zeros to kAlign] [value[0, head)]
//
// (An entry takes as many bytes as [header][value][zeros] would: aligned(64 + V).) The header
// names the value by a 16-byte hash of its name and carries a checksum of its own fields, so a
// torn or overwritten header is seen (the value itself is checked by its tier record). A sealed
// (full) segment gets an index file beside it: its entries' names, offsets and sizes, with a
// checksum, so that opening the directory reads a few bytes an entry instead of scanning the
// segment.

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

struct iovec;

namespace hicache::detail {

constexpr std::size_t kAlign = 4096;
constexpr std::size_t kEntryHeaderBytes = 64;

inline std::size_t aligned(std::size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }
/// The part of a value that lies aligned at the end of its entry (whole kAlign blocks).
inline std::size_t value_head(std::size_t value_bytes) { return value_bytes / kAlign * kAlign; }
/// Bytes of an entry's lead block(s): the header and the value's tail.
inline std::size_t entry_lead(std::size_t value_bytes) {
  return aligned(kEntryHeaderBytes + value_bytes - value_head(value_bytes));
}
/// Bytes an entry of a value of `value_bytes` takes in its segment.
inline std::size_t entry_extent(std::size_t value_bytes) {
  return entry_lead(value_bytes) + value_head(value_bytes);
}

using NameHash = std::array<std::uint8_t, 16>;
NameHash name_hash(std::string_view name);
struct NameHashHasher {
  std::size_t operator()(const NameHash& h) const;
};

/// Writes an entry's header into the first kEntryHeaderBytes of `out`.
void write_entry_header(std::byte* out, const NameHash& name, std::uint64_t value_bytes,
                        std::uint64_t sequence);
/// The header's name hash and value size, if it checks out (magic, version, checksum) and the
/// value fits in `room` bytes after it.
struct EntryInfo {
  NameHash name;
  std::uint64_t value_bytes = 0;
  std::uint64_t sequence = 0;
};
std::optional<EntryInfo> read_entry_header(const std::byte* in, std::size_t room);

/// A segment's entry, as the index knows it.
struct SegmentEntry {
  NameHash name;
  std::uint64_t offset = 0;
  std::uint64_t value_bytes = 0;
};

/// Memory aligned for direct I/O, freed on destruction.
class AlignedBuffer {
 public:
  AlignedBuffer() = default;
  explicit AlignedBuffer(std::size_t bytes);
  AlignedBuffer(AlignedBuffer&& o) noexcept;
  AlignedBuffer& operator=(AlignedBuffer&& o) noexcept;
  ~AlignedBuffer();
  std::byte* data() const { return data_; }
  std::size_t size() const { return size_; }
  /// Grows (never shrinks) to at least `bytes`; the contents are not kept.
  void reserve(std::size_t bytes);

 private:
  std::byte* data_ = nullptr;
  std::size_t size_ = 0;
};

/// One open segment file. Reads may run on several threads at once; appends are the writer's.
class SegmentFile {
 public:
  /// Opens (create: a new, empty file) `path`. `direct`: with O_DIRECT.
  /// @throws hicache::Error with the call and errno's text.
  SegmentFile(std::string path, std::uint64_t id, bool create, bool direct, bool writable);
  ~SegmentFile();
  SegmentFile(const SegmentFile&) = delete;
  SegmentFile& operator=(const SegmentFile&) = delete;

  std::uint64_t id() const { return id_; }
  const std::string& path() const { return path_; }
  std::uint64_t size() const { return size_; }
  bool direct() const { return direct_; }

  /// Appends `bytes` (kAlign-aligned in size and address) at the end. Returns the offset it was
  /// written at, or a negative errno (nothing counted as written then).
  std::int64_t append(const std::byte* bytes, std::size_t n);
  /// Writes `bytes` at `offset` (aligned as for append) without moving the end: the writer
  /// writes a run in pieces, then moves the end past the ones that landed (set_size).
  /// Returns 0 or a negative errno.
  int write_at(const std::byte* bytes, std::size_t n, std::uint64_t offset) const;
  /// Writes the buffers `iov` (direct I/O: each aligned in address and size) at `offset`, one
  /// request where the kernel takes it whole. Returns 0 or a negative errno. `iov` is consumed.
  int write_at(std::vector<iovec>& iov, std::uint64_t offset) const;
  /// Reads `extent` bytes at `offset` into `buf` (aligned, at least extent).
  /// Returns 0, or a negative errno, or -EIO for a short read (a truncated file).
  int read(std::uint64_t offset, std::size_t extent, std::byte* buf) const;
  /// Reads the bytes at `offset` into the buffers `iov` (aligned as for write_at), one request.
  /// Returns as read() does. `iov` is consumed.
  int read(std::uint64_t offset, std::vector<iovec>& iov) const;
  /// Scans the file's entries from the start, stopping at the first header that does not check
  /// out (the torn end of a segment being written when its process died). `damaged` counts
  /// headers that failed while bytes were left.
  std::vector<SegmentEntry> scan(std::int64_t& damaged) const;
  /// Where appends continue (after a scan of a segment that stays open for writing: the first
  /// bad header's offset).
  void set_size(std::uint64_t size) { size_ = size; }
  /// Removes the file (its open descriptor keeps reads working until it is closed).
  void unlink() const;

 private:
  std::string path_;
  std::uint64_t id_;
  int fd_ = -1;
  bool direct_;
  std::uint64_t size_ = 0;
};

/// Writes a sealed segment's index file (written to a temporary name, then renamed, so a
/// reader sees either a whole index or none). Returns false on any failure.
bool write_segment_index(const std::string& path, std::uint64_t segment_size,
                         const std::vector<SegmentEntry>& entries);
/// The index file's entries, if it is whole and describes a segment of `segment_size` bytes.
std::optional<std::vector<SegmentEntry>> read_segment_index(const std::string& path,
                                                            std::uint64_t segment_size);

}  // namespace hicache::detail
