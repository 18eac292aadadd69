#include "disk_segment.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <span>

#include "blake2b.hpp"
#include "hicache/error.hpp"
#include "page_checksum.hpp"

namespace hicache::detail {
namespace {

constexpr std::uint32_t kEntryMagic = 0x45444348;  // "HCDE"
constexpr std::uint32_t kIndexMagic = 0x49444348;  // "HCDI"
constexpr std::uint32_t kVersion = 2;  // 2: the value's head last, aligned (disk_segment.hpp)
constexpr std::size_t kIndexHeaderBytes = 32;
constexpr std::size_t kIndexEntryBytes = 32;

template <typename T>
void put(std::byte* at, T v) {
  std::memcpy(at, &v, sizeof v);
}
template <typename T>
T get_field(const std::byte* at) {
  T v;
  std::memcpy(&v, at, sizeof v);
  return v;
}

std::uint64_t sum_of(const std::byte* p, std::size_t n) {
  return checksum_copy(std::span<const std::byte>(p, n), nullptr);
}

[[noreturn]] void fail(const std::string& what, const std::string& path) {
  throw Error(what + " of '" + path + "' failed: " + std::strerror(errno));
}

bool write_all(int fd, const std::byte* p, std::size_t n) {
  while (n > 0) {
    const ssize_t w = ::write(fd, p, n);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return false;
    p += w;
    n -= static_cast<std::size_t>(w);
  }
  return true;
}

// Drops the first `n` bytes of `iov` (what one preadv/pwritev moved), from `first` on.
void advance(std::vector<iovec>& iov, std::size_t& first, std::size_t n) {
  while (n > 0 && first < iov.size()) {
    const std::size_t k = std::min(n, iov[first].iov_len);
    iov[first].iov_base = static_cast<char*>(iov[first].iov_base) + k;
    iov[first].iov_len -= k;
    n -= k;
    if (iov[first].iov_len == 0) ++first;
  }
  while (first < iov.size() && iov[first].iov_len == 0) ++first;
}

// Moves every byte of `iov` at `offset` with `op` (preadv or pwritev), in as few requests as the
// kernel takes (IOV_MAX buffers a request). Returns 0, a negative errno, or -EIO when a request
// moves nothing (a read past the end of a file cut short).
int move_all(int fd, std::vector<iovec>& iov, std::uint64_t offset,
             ssize_t (*op)(int, const iovec*, int, off_t)) {
  std::size_t first = 0;
  advance(iov, first, 0);
  while (first < iov.size()) {
    const int count = static_cast<int>(std::min<std::size_t>(iov.size() - first, IOV_MAX));
    const ssize_t n = op(fd, iov.data() + first, count, static_cast<off_t>(offset));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return -errno;
    if (n == 0) return -EIO;
    offset += static_cast<std::uint64_t>(n);
    advance(iov, first, static_cast<std::size_t>(n));
  }
  return 0;
}

}  // namespace

NameHash name_hash(std::string_view name) {
  Blake2b h(16);
  h.update(name.data(), name.size());
  NameHash out;
  h.finish(out.data());
  return out;
}

std::size_t NameHashHasher::operator()(const NameHash& h) const {
  std::uint64_t v;
  std::memcpy(&v, h.data(), sizeof v);  // a BLAKE2b digest: any 8 bytes are as good as a hash
  return static_cast<std::size_t>(v);
}

void write_entry_header(std::byte* out, const NameHash& name, std::uint64_t value_bytes,
                        std::uint64_t sequence) {
  std::memset(out, 0, kEntryHeaderBytes);
  put(out + 0, kEntryMagic);
  put(out + 4, kVersion);
  std::memcpy(out + 8, name.data(), name.size());
  put(out + 24, value_bytes);
  put(out + 32, sequence);
  put(out + 40, sum_of(out, 40));
}

std::optional<EntryInfo> read_entry_header(const std::byte* in, std::size_t room) {
  if (get_field<std::uint32_t>(in) != kEntryMagic || get_field<std::uint32_t>(in + 4) != kVersion ||
      get_field<std::uint64_t>(in + 40) != sum_of(in, 40)) {
    return std::nullopt;
  }
  EntryInfo e;
  std::memcpy(e.name.data(), in + 8, e.name.size());
  e.value_bytes = get_field<std::uint64_t>(in + 24);
  e.sequence = get_field<std::uint64_t>(in + 32);
  if (e.value_bytes > room) return std::nullopt;
  return e;
}

// --- AlignedBuffer -----------------------------------------------------------------------------

AlignedBuffer::AlignedBuffer(std::size_t bytes) { reserve(bytes); }
AlignedBuffer::AlignedBuffer(AlignedBuffer&& o) noexcept : data_(o.data_), size_(o.size_) {
  o.data_ = nullptr;
  o.size_ = 0;
}
AlignedBuffer& AlignedBuffer::operator=(AlignedBuffer&& o) noexcept {
  std::swap(data_, o.data_);
  std::swap(size_, o.size_);
  return *this;
}
AlignedBuffer::~AlignedBuffer() { std::free(data_); }
void AlignedBuffer::reserve(std::size_t bytes) {
  if (bytes <= size_) return;
  std::free(data_);
  size_ = aligned(bytes);
  data_ = static_cast<std::byte*>(std::aligned_alloc(kAlign, size_));
  if (data_ == nullptr) {
    size_ = 0;
    throw Error("disk tier: no memory for an I/O buffer of " + std::to_string(bytes) + " bytes");
  }
}

// --- SegmentFile -------------------------------------------------------------------------------

SegmentFile::SegmentFile(std::string path, std::uint64_t id, bool create, bool direct,
                         bool writable)
    : path_(std::move(path)), id_(id), direct_(direct) {
  int flags = (writable ? O_RDWR : O_RDONLY) | O_CLOEXEC | (create ? O_CREAT | O_EXCL : 0);
#ifdef O_DIRECT
  if (direct) flags |= O_DIRECT;
#endif
  fd_ = ::open(path_.c_str(), flags, 0600);
  if (fd_ < 0) fail("open", path_);
  struct stat st{};
  if (::fstat(fd_, &st) != 0) {
    const int err = errno;
    ::close(fd_);
    errno = err;
    fail("fstat", path_);
  }
  size_ = static_cast<std::uint64_t>(st.st_size);
}

SegmentFile::~SegmentFile() {
  if (fd_ >= 0) ::close(fd_);
}

int SegmentFile::write_at(const std::byte* bytes, std::size_t n, std::uint64_t offset) const {
  std::size_t done = 0;
  while (done < n) {
    const ssize_t w = ::pwrite(fd_, bytes + done, n - done, static_cast<off_t>(offset + done));
    if (w < 0 && errno == EINTR) continue;
    if (w < 0) return -errno;
    if (w == 0) return -EIO;
    done += static_cast<std::size_t>(w);
  }
  return 0;
}

int SegmentFile::write_at(std::vector<iovec>& iov, std::uint64_t offset) const {
  return move_all(fd_, iov, offset, ::pwritev);
}

int SegmentFile::read(std::uint64_t offset, std::vector<iovec>& iov) const {
  return move_all(fd_, iov, offset, ::preadv);  // -EIO if the file ends early (truncated)
}

std::int64_t SegmentFile::append(const std::byte* bytes, std::size_t n) {
  const std::uint64_t at = size_;
  if (const int rc = write_at(bytes, n, at); rc != 0) return rc;
  size_ = at + n;
  return static_cast<std::int64_t>(at);
}

int SegmentFile::read(std::uint64_t offset, std::size_t extent, std::byte* buf) const {
  std::size_t done = 0;
  while (done < extent) {
    const ssize_t r = ::pread(fd_, buf + done, extent - done, static_cast<off_t>(offset + done));
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) return -errno;
    if (r == 0) return -EIO;  // the file ends early: truncated under the tier
    done += static_cast<std::size_t>(r);
  }
  return 0;
}

std::vector<SegmentEntry> SegmentFile::scan(std::int64_t& damaged) const {
  std::vector<SegmentEntry> out;
  AlignedBuffer block(kAlign);
  std::uint64_t at = 0;
  while (at + kAlign <= size_) {
    if (read(at, kAlign, block.data()) != 0) break;
    const auto e = read_entry_header(block.data(), size_ - at - kEntryHeaderBytes);
    if (!e) {
      ++damaged;  // a torn or damaged header: what follows cannot be found without an index
      break;
    }
    out.push_back({e->name, at, e->value_bytes});
    at += entry_extent(e->value_bytes);
  }
  return out;
}

void SegmentFile::unlink() const { ::unlink(path_.c_str()); }

// --- index files -------------------------------------------------------------------------------

bool write_segment_index(const std::string& path, std::uint64_t segment_size,
                         const std::vector<SegmentEntry>& entries) {
  std::vector<std::byte> buf(kIndexHeaderBytes + entries.size() * kIndexEntryBytes);
  std::byte* p = buf.data() + kIndexHeaderBytes;
  for (const SegmentEntry& e : entries) {
    std::memcpy(p, e.name.data(), e.name.size());
    put(p + 16, e.offset);
    put(p + 24, e.value_bytes);
    p += kIndexEntryBytes;
  }
  put(buf.data() + 0, kIndexMagic);
  put(buf.data() + 4, kVersion);
  put(buf.data() + 8, static_cast<std::uint64_t>(entries.size()));
  put(buf.data() + 16, segment_size);
  put(buf.data() + 24, sum_of(buf.data(), 24) ^
                           sum_of(buf.data() + kIndexHeaderBytes, buf.size() - kIndexHeaderBytes));
  const std::string tmp = path + ".tmp";
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) return false;
  const bool ok = write_all(fd, buf.data(), buf.size());
  ::close(fd);
  if (!ok || ::rename(tmp.c_str(), path.c_str()) != 0) {
    ::unlink(tmp.c_str());
    return false;
  }
  return true;
}

std::optional<std::vector<SegmentEntry>> read_segment_index(const std::string& path,
                                                            std::uint64_t segment_size) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return std::nullopt;
  std::vector<std::byte> buf;
  std::byte chunk[1 << 16];
  for (;;) {
    const ssize_t n = ::read(fd, chunk, sizeof chunk);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    buf.insert(buf.end(), chunk, chunk + n);
  }
  ::close(fd);
  if (buf.size() < kIndexHeaderBytes || get_field<std::uint32_t>(buf.data()) != kIndexMagic ||
      get_field<std::uint32_t>(buf.data() + 4) != kVersion) {
    return std::nullopt;
  }
  const auto count = get_field<std::uint64_t>(buf.data() + 8);
  if (get_field<std::uint64_t>(buf.data() + 16) != segment_size ||
      buf.size() != kIndexHeaderBytes + count * kIndexEntryBytes ||
      get_field<std::uint64_t>(buf.data() + 24) !=
          (sum_of(buf.data(), 24) ^
           sum_of(buf.data() + kIndexHeaderBytes, buf.size() - kIndexHeaderBytes))) {
    return std::nullopt;
  }
  std::vector<SegmentEntry> out(count);
  const std::byte* p = buf.data() + kIndexHeaderBytes;
  for (auto& e : out) {
    std::memcpy(e.name.data(), p, e.name.size());
    e.offset = get_field<std::uint64_t>(p + 16);
    e.value_bytes = get_field<std::uint64_t>(p + 24);
    if (e.offset + entry_extent(e.value_bytes) > segment_size) return std::nullopt;
    p += kIndexEntryBytes;
  }
  return out;
}

}  // namespace hicache::detail
