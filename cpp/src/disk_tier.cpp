#include "hicache/disk_tier.hpp"

#include <dirent.h>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <deque>
#include <filesystem>
#include <functional>
#include <future>
#include <map>
#include <mutex>
#include <stdexcept>
#include <thread>
#include <unordered_map>
#include <variant>

#include "disk_segment.hpp"
#include "hicache/error.hpp"

namespace hicache {

using detail::AlignedBuffer;
using detail::entry_extent;
using detail::entry_lead;
using detail::kAlign;
using detail::kEntryHeaderBytes;
using detail::NameHash;
using detail::SegmentEntry;
using detail::SegmentFile;
using detail::value_head;

namespace {

// 2: an entry's value head lies last and aligned, so direct I/O moves it straight between a host
// slot and the disk (disk_segment.hpp).
constexpr char kFormat[] = "hicache disk tier, format 2\n";
constexpr std::size_t kRefreshQueueBytes = std::size_t{64} << 20;  // values waiting to move up
// A write goes in pieces of this many bytes, the next copied while one is written.
constexpr std::uint64_t kPiece = std::uint64_t{8} << 20;
// A read takes entries that lie back to back in a segment (a prompt's pages do) in one request of
// up to this many bytes, several requests of a batch in flight at once (read_threads): on this
// project's 2-core machine, 64 pages of 1 MiB read one request a page reached 0.9-1.0 GB/s, in
// requests of 4-16 MiB on 8-16 threads 1.3-1.6 GB/s (its raw 64 MiB loop: 1.4-1.7 GB/s).
constexpr std::uint64_t kReadRun = std::uint64_t{4} << 20;
// Entries of one write piece or read run at most: two buffers an entry (its lead block, its
// head), within the kernel's IOV_MAX (1024) of one request.
constexpr std::size_t kRunEntries = 256;

std::string errno_text(int err) { return std::strerror(err < 0 ? -err : err); }

std::string segment_name(std::uint64_t id, const char* ext) {
  char buf[48];
  std::snprintf(buf, sizeof buf, "seg-%020llu.%s", static_cast<unsigned long long>(id), ext);
  return buf;
}

std::optional<std::uint64_t> segment_id(const std::string& file) {
  if (file.size() != 28 || file.rfind("seg-", 0) != 0 || file.substr(24) != ".hcd") {
    return std::nullopt;
  }
  std::uint64_t id = 0;
  for (std::size_t i = 4; i < 24; ++i) {
    if (file[i] < '0' || file[i] > '9') return std::nullopt;
    id = id * 10 + static_cast<std::uint64_t>(file[i] - '0');
  }
  return id;
}

std::optional<std::string> read_small_file(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return std::nullopt;
  std::string out;
  char buf[512];
  ssize_t n;
  while ((n = ::read(fd, buf, sizeof buf)) > 0 && out.size() < 4096) out.append(buf, n);
  ::close(fd);
  return out;
}

// Whether files in `dir` can be opened with O_DIRECT and written through it.
bool direct_io_works(const std::string& dir) {
#ifdef O_DIRECT
  const std::string probe = dir + "/.direct-probe";
  const int fd = ::open(probe.c_str(), O_RDWR | O_CREAT | O_TRUNC | O_DIRECT | O_CLOEXEC, 0600);
  if (fd < 0) return false;
  AlignedBuffer block(kAlign);
  std::memset(block.data(), 0, kAlign);
  const bool ok = ::pwrite(fd, block.data(), kAlign, 0) == static_cast<ssize_t>(kAlign);
  ::close(fd);
  ::unlink(probe.c_str());
  return ok;
#else
  (void)dir;
  return false;
#endif
}

}  // namespace

void DiskTierOptions::validate() const {
  if (path.empty()) throw std::invalid_argument("DiskTier: path is empty");
  if (capacity_bytes < static_cast<std::int64_t>(2 * kAlign)) {
    throw std::invalid_argument("DiskTier: capacity_bytes must be at least 8192 (got " +
                                std::to_string(capacity_bytes) + ")");
  }
  if (segment_bytes < 0 ||
      (segment_bytes > 0 && segment_bytes < static_cast<std::int64_t>(kAlign))) {
    throw std::invalid_argument("DiskTier: segment_bytes must be 0 (automatic) or at least 4096");
  }
  if (direct_io != "auto" && direct_io != "on" && direct_io != "off") {
    throw std::invalid_argument("DiskTier: direct_io must be 'auto', 'on' or 'off', not '" +
                                direct_io + "'");
  }
  if (read_threads < 1 || read_threads > 64) {
    throw std::invalid_argument("DiskTier: read_threads must be in [1, 64]");
  }
}

struct DiskTier::Impl {
  // Where a value is: the segment file (kept open by the pointer, so a read never loses its
  // file to an eviction), the entry's offset and the value's size.
  struct Loc {
    std::shared_ptr<SegmentFile> file;
    std::uint64_t offset = 0;
    std::uint64_t value_bytes = 0;
  };
  struct Segment {
    std::shared_ptr<SegmentFile> file;
    std::vector<SegmentEntry> entries;
  };
  struct PutJob {
    std::int64_t batch;
    std::vector<NameHash> names;
    std::vector<const std::byte*> values;
    std::vector<std::size_t> sizes;
  };
  struct RefreshJob {  // a value read from the older half, to be written again at the head
    NameHash name;
    Loc from;
    std::vector<std::byte> value;
  };
  struct Batch {
    std::vector<std::int64_t> results;
    std::size_t parts_left = 0;
    bool done = false;
  };

  DiskTierOptions o;
  std::uint64_t segment_bytes = 0;
  bool direct = false;
  bool read_only = false;
  int lock_fd = -1;

  mutable std::mutex mu;
  std::condition_variable done_cv;
  std::unordered_map<NameHash, Loc, detail::NameHashHasher> index;
  std::deque<Segment> segments;  // oldest first; the last takes appends
  bool active_open = false;      // the last segment takes appends (a new one is made otherwise)
  std::uint64_t next_segment = 1;
  std::uint64_t sequence = 1;
  std::uint64_t bytes_on_disk = 0;
  std::map<std::int64_t, Batch> batches;
  std::int64_t next_batch = 1;
  DiskTierStats st;
  // Values go straight between host memory and the disk (no copy through an aligned buffer)
  // while this holds; a request that fails for its memory (EFAULT, EINVAL: memory that direct
  // I/O cannot pin, a misaligned buffer) clears it and is made again through a buffer.
  std::atomic<bool> zero_copy{true};

  // The writer: puts and refreshes, in order, on one thread.
  std::deque<std::variant<PutJob, RefreshJob>> writes;
  std::size_t refresh_bytes = 0;
  std::condition_variable write_cv;
  // Readers: parts of get batches.
  std::deque<std::function<void(AlignedBuffer&, std::vector<iovec>&)>> reads;
  std::condition_variable read_cv;
  bool stopping = false;
  std::thread writer;
  std::vector<std::thread> readers;

  explicit Impl(DiskTierOptions options) : o(std::move(options)) {
    o.validate();
    const auto t0 = std::chrono::steady_clock::now();
    open_directory();
    load_segments();
    st.index_rebuild_s =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    writer = std::thread([this] { write_loop(); });
    for (int i = 0; i < o.read_threads; ++i) readers.emplace_back([this] { read_loop(); });
  }

  ~Impl() {
    {
      std::lock_guard<std::mutex> g(mu);
      stopping = true;
    }
    write_cv.notify_all();
    read_cv.notify_all();
    writer.join();  // writes what was queued first
    for (auto& t : readers) t.join();
    if (active_open && !read_only) seal_active();  // the next opening reads its index file
    if (lock_fd >= 0) ::close(lock_fd);            // releases the flock
  }

  // --- opening -------------------------------------------------------------------------------

  std::string file(const std::string& name) const { return o.path + "/" + name; }

  void note(const std::string& what) { st.last_error = what; }  // mu held (or opening)

  void open_directory() {
    std::error_code ec;  // with its parents: a rank's subdirectory of a directory not made yet
    std::filesystem::create_directories(o.path, ec);
    if (ec) throw Error("DiskTier: cannot create directory '" + o.path + "': " + ec.message());
    struct stat sd{};
    if (::stat(o.path.c_str(), &sd) != 0 || !S_ISDIR(sd.st_mode)) {
      throw Error("DiskTier: '" + o.path + "' is not a directory");
    }
    const std::string lock = file("LOCK");
    lock_fd = ::open(lock.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
    if (lock_fd < 0 && (errno == EROFS || errno == EACCES || errno == EPERM)) {
      read_only = true;  // serve what is there; writes fail, counted
      note("directory is read-only: " + errno_text(errno));
    } else if (lock_fd < 0) {
      throw Error("DiskTier: cannot open '" + lock + "': " + errno_text(errno));
    } else if (::flock(lock_fd, LOCK_EX | LOCK_NB) != 0) {
      const std::string holder = read_small_file(lock).value_or("?");
      ::close(lock_fd);
      lock_fd = -1;
      throw Error("DiskTier: directory '" + o.path + "' is in use by another DiskTier (process " +
                  holder.substr(0, holder.find('\n')) +
                  "); one process writes a directory: give each engine its own, or share one "
                  "DiskTier object between the caches of a process");
    } else {
      const std::string pid = std::to_string(::getpid()) + "\n";
      if (::ftruncate(lock_fd, 0) != 0 ||
          ::pwrite(lock_fd, pid.data(), pid.size(), 0) != static_cast<ssize_t>(pid.size())) {
        note("cannot write LOCK: " + errno_text(errno));
      }
    }
    const auto format = read_small_file(file("FORMAT"));
    if (format && *format != kFormat) {
      throw Error("DiskTier: directory '" + o.path + "' holds another format ('" +
                  format->substr(0, format->find('\n')) + "', this build reads '" +
                  std::string(kFormat, sizeof kFormat - 2) +
                  "'): give this tier another directory");
    }
    if (!format) {
      if (!list_segments().empty()) {
        throw Error("DiskTier: directory '" + o.path +
                    "' holds segment files but no FORMAT file: not a directory this tier wrote");
      }
      if (!read_only) write_format();
    }
    if (o.direct_io == "off") {
      direct = false;
    } else {
      direct = !read_only && direct_io_works(o.path);
      if (read_only) direct = o.direct_io == "on";  // opening a segment says whether it works
      if (!direct && o.direct_io == "on") {
        throw Error("DiskTier: direct_io='on' but '" + o.path +
                    "' does not allow direct I/O (tmpfs?); use 'auto' or 'off'");
      }
    }
    const std::uint64_t cap = static_cast<std::uint64_t>(o.capacity_bytes);
    segment_bytes = o.segment_bytes > 0 ? static_cast<std::uint64_t>(o.segment_bytes)
                                        : std::clamp<std::uint64_t>(cap / 16, 4 << 20, 256 << 20);
    segment_bytes =
        std::max<std::uint64_t>(kAlign, std::min(segment_bytes, cap / 2)) / kAlign * kAlign;
  }

  void write_format() {
    const std::string tmp = file("FORMAT.tmp");
    const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    const bool ok = fd >= 0 && ::write(fd, kFormat, sizeof kFormat - 1) ==
                                   static_cast<ssize_t>(sizeof kFormat - 1);
    if (fd >= 0) ::close(fd);
    if (!ok || ::rename(tmp.c_str(), file("FORMAT").c_str()) != 0) {
      throw Error("DiskTier: cannot write '" + file("FORMAT") + "': " + errno_text(errno));
    }
  }

  std::vector<std::uint64_t> list_segments() const {
    std::vector<std::uint64_t> ids;
    DIR* dir = ::opendir(o.path.c_str());
    if (dir == nullptr) return ids;
    while (const dirent* ent = ::readdir(dir)) {
      if (auto id = segment_id(ent->d_name)) ids.push_back(*id);
    }
    ::closedir(dir);
    std::sort(ids.begin(), ids.end());
    return ids;
  }

  std::shared_ptr<SegmentFile> open_segment(std::uint64_t id, bool create, bool writable) {
    try {
      return std::make_shared<SegmentFile>(file(segment_name(id, "hcd")), id, create, direct,
                                           writable);
    } catch (const Error&) {
      if (!direct || create) throw;
      direct = false;  // a read-only directory on a filesystem without direct I/O
      return std::make_shared<SegmentFile>(file(segment_name(id, "hcd")), id, false, false,
                                           writable);
    }
  }

  void load_segments() {
    const auto ids = list_segments();
    for (std::size_t k = 0; k < ids.size(); ++k) {
      const std::uint64_t id = ids[k];
      const bool last = k + 1 == ids.size();
      std::shared_ptr<SegmentFile> f;
      try {
        f = open_segment(id, false, last && !read_only);
      } catch (const Error& e) {
        note(e.what());
        ++st.damaged_entries;
        continue;
      }
      Segment seg{f, {}};
      if (auto entries = detail::read_segment_index(file(segment_name(id, "idx")), f->size())) {
        seg.entries = std::move(*entries);
        ++st.index_files_used;
      } else {
        seg.entries = f->scan(st.damaged_entries);
        ++st.segments_scanned;
        const std::uint64_t end =
            seg.entries.empty()
                ? 0
                : seg.entries.back().offset + entry_extent(seg.entries.back().value_bytes);
        if (last && !read_only) {
          // The segment being written when its process ended: appends go on after its last
          // whole entry (a torn one after it is overwritten).
          f->set_size(end);
          active_open = true;
        } else if (end < f->size()) {
          f->set_size(end);  // what follows a damaged header cannot be found
        }
      }
      for (const SegmentEntry& e : seg.entries) index[e.name] = {f, e.offset, e.value_bytes};
      bytes_on_disk += f->size();
      segments.push_back(std::move(seg));
      next_segment = id + 1;
    }
    if (!read_only) {
      while (bytes_on_disk > static_cast<std::uint64_t>(o.capacity_bytes) && !segments.empty()) {
        evict_oldest();  // the capacity was lowered since
      }
    }
  }

  // --- the writer ----------------------------------------------------------------------------

  // mu held. Drops the oldest segment: its names leave the index where it is where they are.
  void evict_oldest() {
    Segment& seg = segments.front();
    for (const SegmentEntry& e : seg.entries) {
      auto it = index.find(e.name);
      if (it != index.end() && it->second.file == seg.file && it->second.offset == e.offset) {
        index.erase(it);
      }
    }
    bytes_on_disk -= seg.file->size();
    seg.file->unlink();
    ::unlink(file(segment_name(seg.file->id(), "idx")).c_str());
    if (segments.size() == 1) active_open = false;
    segments.pop_front();
    ++st.segments_evicted;
  }

  // mu held. The active segment gets its index file and takes no more appends.
  void seal_active() {
    if (!active_open || segments.empty()) return;
    const Segment& seg = segments.back();
    if (!detail::write_segment_index(file(segment_name(seg.file->id(), "idx")), seg.file->size(),
                                     seg.entries)) {
      note("cannot write the index file of segment " + std::to_string(seg.file->id()));
    }
    active_open = false;
  }

  // mu held. A segment that takes `extent` more bytes, or nullptr (noted) if none can be made.
  Segment* room_for(std::uint64_t extent) {
    if (active_open) {
      Segment& a = segments.back();
      if (a.file->size() == 0 || a.file->size() + extent <= segment_bytes) return &a;
      seal_active();
    }
    try {
      segments.push_back({open_segment(next_segment++, true, true), {}});
    } catch (const Error& e) {
      note(e.what());
      return nullptr;
    }
    active_open = true;
    return &segments.back();
  }

  // mu held. Room in the directory's capacity for `extent` more bytes (oldest segments out).
  void make_room(std::uint64_t extent) {
    const auto cap = static_cast<std::uint64_t>(o.capacity_bytes);
    while (bytes_on_disk + extent > cap && segments.size() > (active_open ? 1u : 0u)) {
      evict_oldest();
    }
  }

  // Whether a value at `p` can go straight between its memory and the disk.
  bool straight_ok(const void* p) const {
    return !direct || reinterpret_cast<std::uintptr_t>(p) % kAlign == 0;
  }

  // Lays entries [k, end) out for one write: each one's lead block (header, the value's tail) in
  // `buf`, then its head, from the value's own memory where `straight` allows it and the memory
  // is aligned, else copied into `buf`. Returns the values that go straight.
  std::int64_t lay_out(const std::vector<NameHash>& names,
                       const std::vector<const std::byte*>& values,
                       const std::vector<std::size_t>& sizes, const std::uint64_t* seqs,
                       std::size_t k, std::size_t end, AlignedBuffer& buf, std::vector<iovec>& iov,
                       bool straight) const {
    std::size_t staged = 0;
    for (std::size_t e = k; e < end; ++e) {
      const bool own = straight && straight_ok(values[e]);
      staged += entry_lead(sizes[e]) + (own ? 0 : value_head(sizes[e]));
    }
    buf.reserve(staged);
    iov.clear();
    std::int64_t direct_values = 0;
    std::byte* p = buf.data();
    for (std::size_t e = k; e < end; ++e) {
      const std::size_t head = value_head(sizes[e]), lead = entry_lead(sizes[e]);
      const std::size_t tail = sizes[e] - head;
      detail::write_entry_header(p, names[e], sizes[e], seqs[e - k]);
      std::memcpy(p + kEntryHeaderBytes, values[e] + head, tail);
      std::memset(p + kEntryHeaderBytes + tail, 0, lead - kEntryHeaderBytes - tail);
      add_buffer(iov, p, lead);
      p += lead;
      if (head == 0) continue;
      if (straight && straight_ok(values[e])) {
        add_buffer(iov, const_cast<std::byte*>(values[e]), head);  // pwritev only reads it
        ++direct_values;
      } else {
        std::memcpy(p, values[e], head);
        add_buffer(iov, p, head);
        p += head;
      }
    }
    return direct_values;
  }

  // Appends a buffer to a request, merged with the last one where they are contiguous.
  static void add_buffer(std::vector<iovec>& iov, std::byte* p, std::size_t n) {
    if (!iov.empty() && static_cast<std::byte*>(iov.back().iov_base) + iov.back().iov_len == p) {
      iov.back().iov_len += n;
    } else {
      iov.push_back({p, n});
    }
  }

  // Appends entries (name, value) in order; returns each one's Loc or nullopt. Takes mu around
  // its bookkeeping only: the writes themselves run unlocked (reads go on meanwhile).
  std::vector<std::optional<Loc>> append(const std::vector<NameHash>& names,
                                         const std::vector<const std::byte*>& values,
                                         const std::vector<std::size_t>& sizes,
                                         AlignedBuffer (&staging)[2]) {
    std::vector<std::optional<Loc>> out(names.size());
    std::size_t i = 0;
    while (i < names.size()) {
      std::unique_lock<std::mutex> g(mu);
      if (read_only) {
        st.write_failures += static_cast<std::int64_t>(names.size() - i);
        return out;
      }
      // A run of entries that fits the active segment: one write.
      const std::uint64_t first_extent = entry_extent(sizes[i]);
      if (first_extent > static_cast<std::uint64_t>(o.capacity_bytes)) {
        ++st.write_failures;
        note("a value of " + std::to_string(sizes[i]) + " bytes exceeds the capacity");
        ++i;
        continue;
      }
      make_room(first_extent);
      Segment* seg = room_for(first_extent);
      if (seg == nullptr) {
        st.write_failures += static_cast<std::int64_t>(names.size() - i);
        return out;
      }
      std::shared_ptr<SegmentFile> f = seg->file;
      std::uint64_t run = 0;
      std::size_t j = i;
      while (j < names.size()) {
        const std::uint64_t e = entry_extent(sizes[j]);
        if (run > 0 && (f->size() + run + e > segment_bytes ||
                        bytes_on_disk + run + e > static_cast<std::uint64_t>(o.capacity_bytes))) {
          break;
        }
        run += e;
        ++j;
      }
      std::vector<std::uint64_t> seqs;
      for (std::size_t k = i; k < j; ++k) seqs.push_back(sequence++);
      const std::uint64_t start = f->size();
      g.unlock();
      // The run goes in pieces of whole entries (up to kPiece bytes): each is laid out (its
      // lead blocks written, the heads of values in unaligned memory copied) in one staging
      // buffer while the piece before it is written from the other.
      std::size_t landed = i;  // entries [i, landed) are on disk
      std::uint64_t landed_end = start;
      std::int64_t straight = 0;  // values of landed pieces written from their own memory
      int rc = 0;
      {
        std::future<int> writing;
        std::size_t writing_begin = i, writing_end = i;
        std::uint64_t writing_bytes = 0, writing_at = start;
        std::int64_t writing_straight = 0;
        std::vector<iovec> iovs[2];
        // Waits for the piece in flight; one that failed for its memory is written again, staged.
        auto land = [&]() {
          int r = writing.get();
          if (r != 0 && writing_straight > 0 && (r == -EFAULT || r == -EINVAL)) {
            zero_copy = false;
            AlignedBuffer again;
            std::vector<iovec> iov;
            lay_out(names, values, sizes, seqs.data() + (writing_begin - i), writing_begin,
                    writing_end, again, iov, false);
            r = f->write_at(iov, writing_at);
            writing_straight = 0;
          }
          if (r == 0) {
            landed = writing_end;
            landed_end += writing_bytes;
            straight += writing_straight;
          }
          return r;
        };
        std::uint64_t at = start;
        std::size_t k = i;
        for (int piece = 0; k < j && rc == 0; ++piece) {
          std::size_t end = k;
          std::uint64_t bytes = 0;
          while (end < j && end - k < kRunEntries &&
                 (bytes == 0 || bytes + entry_extent(sizes[end]) <= kPiece)) {
            bytes += entry_extent(sizes[end]);
            ++end;
          }
          std::vector<iovec>& iov = iovs[piece % 2];
          const std::int64_t direct_values =
              lay_out(names, values, sizes, seqs.data() + (k - i), k, end, staging[piece % 2], iov,
                      zero_copy.load());
          if (writing.valid()) {
            rc = land();
            if (rc != 0) break;
          }
          writing = std::async(std::launch::async, [&f, &iov, at] { return f->write_at(iov, at); });
          writing_begin = k;
          writing_end = end;
          writing_bytes = bytes;
          writing_at = at;
          writing_straight = direct_values;
          at += bytes;
          k = end;
        }
        if (writing.valid()) {
          const int last = land();
          if (rc == 0) rc = last;
        }
      }
      g.lock();
      f->set_size(landed_end);
      bytes_on_disk += landed_end - start;
      std::uint64_t off = start;
      Segment* owner = nullptr;  // only this thread evicts, but look it up rather than trust it
      for (auto& sg : segments) {
        if (sg.file == f) owner = &sg;
      }
      for (std::size_t e = i; e < landed; ++e) {
        if (owner != nullptr) owner->entries.push_back({names[e], off, sizes[e]});
        out[e] = Loc{f, off, sizes[e]};
        off += entry_extent(sizes[e]);
      }
      st.values_written += static_cast<std::int64_t>(landed - i);
      st.values_written_direct += straight;
      if (rc != 0) {
        st.write_failures += static_cast<std::int64_t>(j - landed);
        note("write to segment " + std::to_string(f->id()) + ": " + errno_text(rc));
        // A full disk: the oldest segment goes, so that later writes have room (these are lost).
        if (rc == -ENOSPC && segments.size() > 1) evict_oldest();
      }
      i = j;
    }
    return out;
  }

  void write_loop() {
    AlignedBuffer staging[2];
    std::unique_lock<std::mutex> g(mu);
    for (;;) {
      write_cv.wait(g, [&] { return stopping || !writes.empty(); });
      if (writes.empty()) return;  // stopping, everything written
      auto job = std::move(writes.front());
      writes.pop_front();
      g.unlock();
      if (auto* put = std::get_if<PutJob>(&job)) {
        const auto locs = append(put->names, put->values, put->sizes, staging);
        g.lock();
        std::vector<std::int64_t> results(locs.size());
        for (std::size_t k = 0; k < locs.size(); ++k) {
          if (locs[k]) {
            index[put->names[k]] = *locs[k];
            results[k] = static_cast<std::int64_t>(put->sizes[k]);
          } else {
            results[k] = kFailed;
          }
        }
        finish(put->batch, std::move(results));
      } else {
        auto& r = std::get<RefreshJob>(job);
        g.lock();
        auto it = index.find(r.name);
        const bool current = it != index.end() && it->second.file == r.from.file &&
                             it->second.offset == r.from.offset;
        refresh_bytes -= r.value.size();
        if (!current) continue;  // written again or evicted since it was read
        g.unlock();
        const auto locs = append({r.name}, {r.value.data()}, {r.value.size()}, staging);
        g.lock();
        it = index.find(r.name);
        if (locs[0] && it != index.end() && it->second.file == r.from.file &&
            it->second.offset == r.from.offset) {
          it->second = *locs[0];
          ++st.values_rewritten;
        }
      }
    }
  }

  // mu held.
  void finish(std::int64_t batch, std::vector<std::int64_t> results) {
    Batch& b = batches[batch];
    b.results = std::move(results);
    b.done = true;
    done_cv.notify_all();
  }

  // --- readers -------------------------------------------------------------------------------

  void read_loop() {
    AlignedBuffer buf(kAlign);
    std::vector<iovec> iov;
    std::unique_lock<std::mutex> g(mu);
    for (;;) {
      read_cv.wait(g, [&] { return stopping || !reads.empty(); });
      if (reads.empty()) return;
      auto job = std::move(reads.front());
      reads.pop_front();
      g.unlock();
      job(buf, iov);
      g.lock();
    }
  }

  // mu held. Whether a value in `file` lies in the older half of the directory.
  bool in_older_half(const std::shared_ptr<SegmentFile>& f) const {
    std::uint64_t older = 0;
    for (const Segment& s : segments) {
      if (s.file == f) return older + s.file->size() <= bytes_on_disk / 2;
      older += s.file->size();
    }
    return false;
  }

  // One value of a get: where the batch wants it, and where the index has it.
  struct Want {
    std::size_t k;  // its place in the batch
    Loc loc;
  };

  // Checks the entry whose lead block was read to `lead` (from w.loc) and hands its value over;
  // results[w.k]. The value's head is at `body`, or already in `dest` (body null: read straight
  // there). Copies run without mu, so that the read threads copy side by side (under mu they
  // took turns, and held up every other call of the tier meanwhile).
  void deliver(const Want& w, const NameHash& name, const std::byte* lead, const std::byte* body,
               int rc, std::byte* dest, std::vector<std::int64_t>& results) {
    const std::size_t bytes = w.loc.value_bytes, head = value_head(bytes);
    std::optional<detail::EntryInfo> info;
    if (rc == 0) info = detail::read_entry_header(lead, entry_extent(bytes) - kEntryHeaderBytes);
    const bool good = rc == 0 && info && info->name == name && info->value_bytes == bytes;
    if (good) {
      if (body != nullptr) std::memcpy(dest, body, head);
      std::memcpy(dest + head, lead + kEntryHeaderBytes, bytes - head);
    }
    std::unique_lock<std::mutex> g(mu);
    if (!good) {
      ++st.read_failures;
      if (rc != 0) {
        note("read of segment " + std::to_string(w.loc.file->id()) + ": " + errno_text(rc));
      } else {
        ++st.damaged_entries;
        note("a damaged entry in segment " + std::to_string(w.loc.file->id()));
      }
      auto it = index.find(name);  // never asked for again
      if (it != index.end() && it->second.file == w.loc.file && it->second.offset == w.loc.offset) {
        index.erase(it);
      }
      results[w.k] = kFailed;
      return;
    }
    results[w.k] = static_cast<std::int64_t>(bytes);
    ++st.values_read;
    if (body == nullptr && head > 0) ++st.values_read_direct;
    if (!read_only && refresh_bytes + bytes <= kRefreshQueueBytes && in_older_half(w.loc.file)) {
      refresh_bytes += bytes;  // its room in the queue, taken before the copy
      g.unlock();
      RefreshJob r{name, w.loc, std::vector<std::byte>(dest, dest + bytes)};
      g.lock();
      writes.emplace_back(std::move(r));
      write_cv.notify_one();
    }
  }

  // Reads a run of entries that lie back to back in one segment, in one request: each entry's
  // lead block into `buf`, its head straight into its destination where the memory allows it
  // (else into `buf` too, then copied). Entry by entry through `buf` if that fails (a file cut
  // short may still hold the first ones).
  void read_run(const std::vector<Want>& run, const std::vector<NameHash>& names,
                const std::vector<std::byte*>& dests, std::vector<std::int64_t>& results,
                AlignedBuffer& buf, std::vector<iovec>& iov) {
    bool straight = zero_copy.load();
    for (const Want& w : run) straight = straight && straight_ok(dests[w.k]);
    if (run.size() > 1 || straight) {
      std::size_t staged = 0;
      for (const Want& w : run) {
        staged += entry_lead(w.loc.value_bytes) + (straight ? 0 : value_head(w.loc.value_bytes));
      }
      buf.reserve(staged);
      iov.clear();
      std::byte* p = buf.data();
      for (const Want& w : run) {
        const std::size_t head = value_head(w.loc.value_bytes);
        add_buffer(iov, p, entry_lead(w.loc.value_bytes));
        p += entry_lead(w.loc.value_bytes);
        if (head == 0) continue;
        add_buffer(iov, straight ? dests[w.k] : p, head);
        if (!straight) p += head;
      }
      const int rc = run.front().loc.file->read(run.front().loc.offset, iov);
      if (rc == 0) {
        p = buf.data();
        for (const Want& w : run) {
          const std::size_t lead = entry_lead(w.loc.value_bytes);
          deliver(w, names[w.k], p, straight ? nullptr : p + lead, 0, dests[w.k], results);
          p += lead + (straight ? 0 : value_head(w.loc.value_bytes));
        }
        return;
      }
      if (straight && (rc == -EFAULT || rc == -EINVAL)) zero_copy = false;
    }
    for (const Want& w : run) {
      const std::size_t extent = entry_extent(w.loc.value_bytes);
      buf.reserve(extent);
      const int rc = w.loc.file->read(w.loc.offset, extent, buf.data());
      deliver(w, names[w.k], buf.data(), buf.data() + entry_lead(w.loc.value_bytes), rc, dests[w.k],
              results);
    }
  }
};

DiskTier::DiskTier(DiskTierOptions options) : impl_(std::make_unique<Impl>(std::move(options))) {}
DiskTier::~DiskTier() = default;

const DiskTierOptions& DiskTier::options() const { return impl_->o; }

std::size_t DiskTier::value_alignment() const { return impl_->direct ? kAlign : 0; }

std::int64_t DiskTier::put(std::span<const std::string> names,
                           std::span<const std::byte* const> values,
                           std::span<const std::size_t> sizes) {
  if (names.size() != values.size() || names.size() != sizes.size()) {
    throw std::invalid_argument("DiskTier::put: names, values and sizes differ in length");
  }
  Impl::PutJob job;
  for (const std::string& n : names) job.names.push_back(detail::name_hash(n));
  job.values.assign(values.begin(), values.end());
  job.sizes.assign(sizes.begin(), sizes.end());
  std::lock_guard<std::mutex> g(impl_->mu);
  job.batch = impl_->next_batch++;
  impl_->batches[job.batch];
  const std::int64_t batch = job.batch;
  impl_->writes.emplace_back(std::move(job));
  impl_->write_cv.notify_one();
  return batch;
}

std::int64_t DiskTier::get(std::span<const std::string> names, std::span<std::byte* const> dests,
                           std::size_t capacity) {
  if (names.size() != dests.size()) {
    throw std::invalid_argument("DiskTier::get: names and dests differ in length");
  }
  struct Shared {
    std::vector<NameHash> names;
    std::vector<std::byte*> dests;
    std::vector<std::int64_t> results;
    std::vector<std::vector<Impl::Want>> runs;
    std::atomic<std::size_t> left{0};
  };
  auto s = std::make_shared<Shared>();
  for (const std::string& n : names) s->names.push_back(detail::name_hash(n));
  s->dests.assign(dests.begin(), dests.end());
  s->results.assign(names.size(), Tier::kFailed);
  Impl& im = *impl_;
  std::lock_guard<std::mutex> g(im.mu);
  const std::int64_t batch = im.next_batch++;
  // Where each value is; then runs of values that lie back to back in a segment (a prompt's
  // pages were appended together), each read in one request.
  std::vector<Impl::Want> found;
  for (std::size_t k = 0; k < s->names.size(); ++k) {
    auto it = im.index.find(s->names[k]);
    if (it == im.index.end()) {
      s->results[k] = Tier::kMissing;
    } else if (it->second.value_bytes > capacity) {
      s->results[k] = Tier::kFailed;  // larger than the reader's slot: not this layout's page
    } else {
      found.push_back({k, it->second});
    }
  }
  if (found.empty()) {
    im.finish(batch, std::move(s->results));
    return batch;
  }
  std::sort(found.begin(), found.end(), [](const Impl::Want& a, const Impl::Want& b) {
    return a.loc.file->id() != b.loc.file->id() ? a.loc.file->id() < b.loc.file->id()
                                                : a.loc.offset < b.loc.offset;
  });
  for (const Impl::Want& w : found) {
    auto* run = s->runs.empty() ? nullptr : &s->runs.back();
    if (run != nullptr) {
      const Impl::Loc& last = run->back().loc;
      const std::uint64_t end = last.offset + entry_extent(last.value_bytes);
      if (last.file == w.loc.file && end == w.loc.offset && run->size() < kRunEntries &&
          end + entry_extent(w.loc.value_bytes) - run->front().loc.offset <= kReadRun) {
        run->push_back(w);
        continue;
      }
    }
    s->runs.push_back({w});
  }
  im.batches[batch];
  const std::size_t parts =
      std::min<std::size_t>(static_cast<std::size_t>(im.o.read_threads), s->runs.size());
  s->left = parts;
  for (std::size_t p = 0; p < parts; ++p) {
    im.reads.emplace_back([&im, s, batch, p, parts](AlignedBuffer& buf, std::vector<iovec>& iov) {
      for (std::size_t r = p; r < s->runs.size(); r += parts) {
        im.read_run(s->runs[r], s->names, s->dests, s->results, buf, iov);
      }
      if (s->left.fetch_sub(1) == 1) {
        std::lock_guard<std::mutex> g2(im.mu);
        im.finish(batch, std::move(s->results));
      }
    });
  }
  im.read_cv.notify_all();
  return batch;
}

std::int64_t DiskTier::exists(std::span<const std::string> names) {
  std::vector<std::int64_t> results;
  std::vector<NameHash> hashes;
  for (const std::string& n : names) hashes.push_back(detail::name_hash(n));
  std::lock_guard<std::mutex> g(impl_->mu);
  for (const NameHash& h : hashes) results.push_back(impl_->index.count(h) ? 1 : 0);
  const std::int64_t batch = impl_->next_batch++;
  impl_->finish(batch, std::move(results));
  return batch;
}

std::optional<std::vector<std::int64_t>> DiskTier::poll(std::int64_t batch) {
  std::lock_guard<std::mutex> g(impl_->mu);
  auto it = impl_->batches.find(batch);
  if (it == impl_->batches.end()) {
    throw std::invalid_argument("DiskTier::poll: unknown batch " + std::to_string(batch));
  }
  if (!it->second.done) return std::nullopt;
  auto results = std::move(it->second.results);
  impl_->batches.erase(it);
  return results;
}

bool DiskTier::wait(std::int64_t batch, std::chrono::microseconds timeout) {
  std::unique_lock<std::mutex> g(impl_->mu);
  impl_->done_cv.wait_for(g, timeout, [&] {
    auto it = impl_->batches.find(batch);
    return it == impl_->batches.end() || it->second.done;
  });
  return true;
}

DiskTierStats DiskTier::stats() const {
  std::lock_guard<std::mutex> g(impl_->mu);
  DiskTierStats s = impl_->st;
  s.values = static_cast<std::int64_t>(impl_->index.size());
  s.bytes_on_disk = static_cast<std::int64_t>(impl_->bytes_on_disk);
  s.segments = static_cast<std::int64_t>(impl_->segments.size());
  s.direct_io = impl_->direct;
  s.read_only = impl_->read_only;
  return s;
}

}  // namespace hicache
