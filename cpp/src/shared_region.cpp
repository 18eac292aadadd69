#include "hicache/shared_region.hpp"

#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string_view>
#include <thread>

#include "hicache/error.hpp"

namespace hicache {
namespace {

constexpr char kMagic[16] = "hicache region";
constexpr std::uint32_t kVersion = 1;
constexpr std::size_t kHeaderBytes = 4096;  // the data starts page-aligned after it

// The first 4 KiB of a region's file. Written by the creator before `ready` is set (release);
// read by attachers after seeing it set (acquire) and by reclaim_shared_regions.
struct Header {
  char magic[16];
  std::uint32_t version;
  std::uint32_t ready;  // 0 while the creator sets the region up, 1 once it may be attached to
  std::uint64_t data_bytes;
  std::int64_t creator_pid;
  std::uint64_t creator_start;  // clock ticks after boot (/proc/<pid>/stat, field 22)
  char owner[1024];
  char layout[1024];
};
static_assert(sizeof(Header) <= kHeaderBytes);

// When process `pid` started (clock ticks after boot), or nullopt if it does not exist.
std::optional<std::uint64_t> start_time(std::int64_t pid) {
  const std::string path = "/proc/" + std::to_string(pid) + "/stat";
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return std::nullopt;
  char buf[1024];
  const ssize_t n = ::read(fd, buf, sizeof buf - 1);
  ::close(fd);
  if (n <= 0) return std::nullopt;
  const std::string_view stat(buf, static_cast<std::size_t>(n));
  // "pid (comm) state ppid ...": comm may hold spaces and parentheses; fields resume after the
  // last ')'. The start time is field 22, the 20th after comm.
  std::size_t at = stat.rfind(')');
  if (at == std::string_view::npos) return std::nullopt;
  for (int field = 3; field < 22; ++field) {
    at = stat.find(' ', at + 1);
    if (at == std::string_view::npos) return std::nullopt;
  }
  std::uint64_t ticks = 0;
  const char* first = stat.data() + at + 1;
  const auto [end, ec] = std::from_chars(first, stat.data() + stat.size(), ticks);
  if (ec != std::errc() || end == first) return std::nullopt;
  return ticks;
}

// Whether the process that wrote `h` is still running (the same process, not a reused pid).
bool creator_alive(const Header& h) {
  if (h.creator_pid <= 0) return false;
  if (::kill(static_cast<pid_t>(h.creator_pid), 0) != 0 && errno != EPERM) return false;
  const auto start = start_time(h.creator_pid);
  return !start || *start == h.creator_start;  // unreadable /proc: trust kill()
}

bool has_magic(const Header& h) {
  return std::memcmp(h.magic, kMagic, sizeof kMagic) == 0 && h.version == kVersion;
}

std::optional<Header> read_header(int fd) {
  Header h{};
  if (::pread(fd, &h, sizeof h, 0) != static_cast<ssize_t>(sizeof h)) return std::nullopt;
  h.owner[sizeof h.owner - 1] = '\0';
  h.layout[sizeof h.layout - 1] = '\0';
  return h;
}

std::optional<Header> read_header(const std::string& name) {
  const int fd = ::shm_open(("/" + name).c_str(), O_RDONLY, 0);
  if (fd < 0) return std::nullopt;
  auto h = read_header(fd);
  ::close(fd);
  return h;
}

void copy_field(char* dst, std::size_t size, const std::string& src, const char* what) {
  if (src.size() >= size) {
    throw std::invalid_argument(std::string("shared region: ") + what + " is " +
                                std::to_string(src.size()) + " bytes; at most " +
                                std::to_string(size - 1));
  }
  std::memcpy(dst, src.c_str(), src.size() + 1);
}

// --- names removed at exit and on SIGTERM / SIGHUP ---------------------------------------------
//
// The handler may run at any moment, so what it reads is a fixed table of paths, each published
// by an atomic flag; it only calls unlink(2), which is async-signal-safe.

struct Registered {
  std::atomic<bool> used{false};
  char path[256] = {};
};
Registered g_created[64];
std::mutex g_created_mu;  // add/remove only; never taken by the handler
struct sigaction g_prev_term{};
struct sigaction g_prev_hup{};

void unlink_created() noexcept {
  for (auto& r : g_created) {
    if (r.used.load(std::memory_order_acquire)) ::unlink(r.path);
  }
}

void on_signal(int sig, siginfo_t* info, void* context) {
  unlink_created();
  const struct sigaction& prev = sig == SIGTERM ? g_prev_term : g_prev_hup;
  if ((prev.sa_flags & SA_SIGINFO) != 0) {
    if (prev.sa_sigaction != nullptr) prev.sa_sigaction(sig, info, context);
    return;
  }
  if (prev.sa_handler == SIG_IGN) return;
  if (prev.sa_handler == SIG_DFL) {  // terminate as the signal would have
    ::signal(sig, SIG_DFL);
    ::raise(sig);
    return;
  }
  prev.sa_handler(sig);  // the program's own (Python's, which then runs its handler)
}

// Called at every creation: the handler is (re)installed wherever it is not the current one, so
// a handler the program set after an earlier region (Python's signal.signal replaces, it does
// not chain) is chained to as well. Ignored signals stay ignored.
void install_cleanup() {
  static std::once_flag once;
  std::call_once(once, [] { std::atexit(unlink_created); });
  for (int sig : {SIGTERM, SIGHUP}) {
    struct sigaction current{};
    if (::sigaction(sig, nullptr, &current) != 0) continue;
    const bool ours = (current.sa_flags & SA_SIGINFO) != 0 && current.sa_sigaction == on_signal;
    if (ours || ((current.sa_flags & SA_SIGINFO) == 0 && current.sa_handler == SIG_IGN)) continue;
    (sig == SIGTERM ? g_prev_term : g_prev_hup) = current;
    struct sigaction mine{};
    mine.sa_sigaction = on_signal;
    mine.sa_flags = SA_SIGINFO | SA_RESTART;
    sigemptyset(&mine.sa_mask);
    ::sigaction(sig, &mine, nullptr);
  }
}

void register_created(const std::string& name) {
  install_cleanup();
  const std::string path = "/dev/shm/" + name;
  std::lock_guard<std::mutex> g(g_created_mu);
  for (auto& r : g_created) {
    if (r.used.load(std::memory_order_relaxed)) continue;
    std::memcpy(r.path, path.c_str(), path.size() + 1);  // names are at most 200 bytes
    r.used.store(true, std::memory_order_release);
    return;
  }
  // More than 64 regions in one process: the rest are removed when freed or reclaimed later.
}

void unregister_created(const std::string& name) {
  const std::string path = "/dev/shm/" + name;
  std::lock_guard<std::mutex> g(g_created_mu);
  for (auto& r : g_created) {
    if (r.used.load(std::memory_order_relaxed) && path == r.path) {
      r.used.store(false, std::memory_order_release);
    }
  }
}

// --- the allocator -------------------------------------------------------------------------------

class SharedRegionAllocator final : public HostAllocator {
 public:
  explicit SharedRegionAllocator(SharedRegion region) : r_(std::move(region)) {
    if (r_.name.empty() || r_.name.size() > 200 || r_.name.find('/') != std::string::npos) {
      throw std::invalid_argument("shared memory name must be 1-200 bytes without '/' (got '" +
                                  r_.name + "')");
    }
    Header probe{};
    copy_field(probe.owner, sizeof probe.owner, r_.owner, "owner");
    copy_field(probe.layout, sizeof probe.layout, r_.layout, "layout");
    if (!(r_.attach_timeout_s >= 0)) {
      throw std::invalid_argument("shared region: attach_timeout_s must be >= 0");
    }
  }
  ~SharedRegionAllocator() override {
    if (created_) {
      ::shm_unlink(("/" + r_.name).c_str());
      unregister_created(r_.name);
    }
  }

  void* allocate(std::size_t bytes) override {
    if (base_ != nullptr) {
      throw Error("shared memory '" + r_.name +
                  "' is mapped by one allocation: give the pool a chunk of at least its size");
    }
    std::byte* base = r_.create ? create(bytes) : attach(bytes);
    base_ = base;
    return base + kHeaderBytes;
  }
  void deallocate(void* p, std::size_t bytes) noexcept override {
    ::munmap(static_cast<std::byte*>(p) - kHeaderBytes, bytes + kHeaderBytes);
    base_ = nullptr;
  }
  const char* name() const override { return "shared memory"; }

 private:
  [[noreturn]] void fail(const std::string& what) const {
    throw Error("shared memory '" + r_.name + "': " + what);
  }
  [[noreturn]] void fail_errno(const char* call) const {
    fail(std::string(call) + " failed: " + std::strerror(errno));
  }

  std::byte* map(int fd, std::size_t bytes) const {
    void* p = ::mmap(nullptr, bytes + kHeaderBytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) {
      const int err = errno;
      ::close(fd);
      errno = err;
      fail_errno("mmap");
    }
    ::close(fd);
    return static_cast<std::byte*>(p);
  }

  std::byte* create(std::size_t bytes) {
    reclaim_shared_regions();  // regions of killed processes go first
    const std::string path = "/" + r_.name;
    int fd = -1;
    for (int attempt = 0; fd < 0; ++attempt) {
      fd = ::shm_open(path.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
      if (fd >= 0) break;
      if (errno != EEXIST) fail_errno("shm_open");
      const auto h = read_header(r_.name);
      if (h && has_magic(*h) && !creator_alive(*h) && attempt < 3) {
        ::shm_unlink(path.c_str());  // its creator is gone: nobody can attach to it any more
        continue;
      }
      if (h && has_magic(*h)) {
        fail("in use by process " + std::to_string(h->creator_pid) + " (owner '" + h->owner +
             "'); a region belongs to one engine: give each engine its own name (for vLLM, its "
             "own kv_transfer_config engine_id, or none for a fresh one)");
      }
      fail("exists and is not a hicache region (or is being created right now); remove /dev/shm/" +
           r_.name + " if no process uses it, or choose another name");
    }
    created_ = true;  // from here on the name is ours to remove
    register_created(r_.name);
    if (::ftruncate(fd, static_cast<off_t>(bytes + kHeaderBytes)) != 0) {
      const int err = errno;
      ::close(fd);
      errno = err;
      fail_errno("ftruncate");
    }
    std::byte* base = map(fd, bytes);
    auto* h = reinterpret_cast<Header*>(base);
    std::memcpy(h->magic, kMagic, sizeof kMagic);
    h->version = kVersion;
    h->data_bytes = bytes;
    h->creator_pid = ::getpid();
    h->creator_start = start_time(::getpid()).value_or(0);
    copy_field(h->owner, sizeof h->owner, r_.owner, "owner");
    copy_field(h->layout, sizeof h->layout, r_.layout, "layout");
    std::atomic_ref<std::uint32_t>(h->ready).store(1, std::memory_order_release);
    return base;
  }

  std::byte* attach(std::size_t bytes) {
    const std::string path = "/" + r_.name;
    const auto deadline =
        std::chrono::steady_clock::now() + std::chrono::duration<double>(r_.attach_timeout_s);
    const auto wait_or_fail = [&](const std::string& why) {
      if (std::chrono::steady_clock::now() >= deadline) {
        fail(why + " after " + std::to_string(r_.attach_timeout_s) + " s");
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    };
    for (;;) {
      const int fd = ::shm_open(path.c_str(), O_RDWR, 0);
      if (fd < 0) {
        if (errno != ENOENT) fail_errno("shm_open");
        wait_or_fail("not created");
        continue;
      }
      struct stat st{};
      if (::fstat(fd, &st) != 0 || static_cast<std::size_t>(st.st_size) < kHeaderBytes) {
        ::close(fd);
        wait_or_fail("not set up by its creator");
        continue;
      }
      if (static_cast<std::size_t>(st.st_size) != bytes + kHeaderBytes) {
        ::close(fd);
        fail("holds " + std::to_string(st.st_size - static_cast<off_t>(kHeaderBytes)) +
             " bytes, not the " + std::to_string(bytes) +
             " this pool needs (same layout and slot count in every process?)");
      }
      std::byte* base = map(fd, bytes);
      const auto* h = reinterpret_cast<Header*>(base);
      const bool ready =
          std::atomic_ref<const std::uint32_t>(h->ready).load(std::memory_order_acquire) == 1;
      std::string refused;
      if (!ready) {
        // not set up yet: look again
      } else if (!has_magic(*h)) {
        refused = "is not a hicache region";
      } else if (std::string(h->owner) != r_.owner) {
        refused = "belongs to owner '" + std::string(h->owner) + "', not '" + r_.owner + "'";
      } else if (std::string(h->layout) != r_.layout) {
        refused = "holds slots of layout '" + std::string(h->layout) + "', not '" + r_.layout + "'";
      } else if (!creator_alive(*h)) {
        refused = "was created by process " + std::to_string(h->creator_pid) +
                  ", which is gone: its slots no longer belong to a running catalog";
      } else {
        return base;
      }
      ::munmap(base, bytes + kHeaderBytes);
      if (!refused.empty()) fail(refused + "; not attached");
      wait_or_fail("not ready");
    }
  }

  SharedRegion r_;
  bool created_ = false;
  std::byte* base_ = nullptr;
};

}  // namespace

std::shared_ptr<HostAllocator> make_shared_region_allocator(SharedRegion region) {
  return std::make_shared<SharedRegionAllocator>(std::move(region));
}

std::vector<std::string> reclaim_shared_regions() {
  std::vector<std::string> removed;
  DIR* dir = ::opendir("/dev/shm");
  if (dir == nullptr) return removed;
  while (const dirent* ent = ::readdir(dir)) {
    const std::string name = ent->d_name;
    if (name.rfind("hicache-", 0) != 0) continue;
    const auto h = read_header(name);
    if (!h || !has_magic(*h) || creator_alive(*h)) continue;  // not ours to judge, or alive
    if (::shm_unlink(("/" + name).c_str()) == 0) removed.push_back(name);
  }
  ::closedir(dir);
  return removed;
}

}  // namespace hicache
