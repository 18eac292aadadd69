#include "hicache/host_memory.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstdint>
#include <cstdio>

namespace hicache {
namespace {

// The value of a "Key:   123 kB" line in bytes, if the line is that key's.
std::optional<std::size_t> field(std::string_view line, std::string_view key) {
  if (line.substr(0, key.size()) != key) return std::nullopt;
  line.remove_prefix(key.size());
  const auto digits = line.find_first_not_of(' ');
  if (digits == std::string_view::npos) return std::nullopt;
  line.remove_prefix(digits);
  std::size_t kib = 0;
  const auto [end, ec] = std::from_chars(line.data(), line.data() + line.size(), kib);
  if (ec != std::errc() || end == line.data()) return std::nullopt;
  const std::string_view unit(end, static_cast<std::size_t>(line.data() + line.size() - end));
  if (unit != " kB") return std::nullopt;
  if (kib > (SIZE_MAX >> 10)) return std::nullopt;
  return kib << 10;
}

}  // namespace

std::optional<HostMemory> parse_meminfo(std::string_view text) {
  std::optional<std::size_t> total, available;
  while (!text.empty()) {
    const auto nl = text.find('\n');
    const std::string_view line = text.substr(0, nl);
    if (!total) total = field(line, "MemTotal:");
    if (!available) available = field(line, "MemAvailable:");
    if (nl == std::string_view::npos) break;
    text.remove_prefix(nl + 1);
  }
  if (!total || !available || *total == 0 || *available == 0 || *available > *total) {
    return std::nullopt;
  }
  return HostMemory{*total, *available};
}

std::optional<HostMemory> read_host_memory() {
  const int fd = ::open("/proc/meminfo", O_RDONLY | O_CLOEXEC);
  if (fd < 0) return std::nullopt;
  std::string text;
  char buf[4096];
  for (;;) {
    const ssize_t n = ::read(fd, buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    text.append(buf, static_cast<std::size_t>(n));
    if (text.size() > (1 << 20)) break;  // /proc/meminfo is a few KiB
  }
  ::close(fd);
  return parse_meminfo(text);
}

std::size_t host_memory_reserve(const HostMemory& m) {
  return std::max<std::size_t>(std::size_t{1} << 30, m.total / 32);
}

std::string describe(const HostMemory& m) {
  char out[96];
  std::snprintf(out, sizeof out, "%.1f GiB available of %.1f GiB",
                static_cast<double>(m.available) / (1 << 30),
                static_cast<double>(m.total) / (1 << 30));
  return out;
}

}  // namespace hicache
