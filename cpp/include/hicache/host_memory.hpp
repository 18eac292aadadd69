#pragma once
// How much host memory the machine has and has available (Linux /proc/meminfo), for pools that
// pin ahead of need (HostAllocator::room_for).

#include <cstddef>
#include <optional>
#include <string>
#include <string_view>

namespace hicache {

struct HostMemory {
  std::size_t total = 0;      ///< MemTotal, bytes
  std::size_t available = 0;  ///< MemAvailable, bytes
};

/// MemTotal and MemAvailable from the text of /proc/meminfo, line by line; nullopt unless both
/// are there, positive, and available <= total.
std::optional<HostMemory> parse_meminfo(std::string_view text);

/// This machine's, or nullopt where /proc/meminfo cannot be read or parsed.
///
/// Read with read(2) and parsed with std::from_chars, never with iostreams: inside a Python
/// process on an H200 host (torch 2.11, Python 3.12), `std::ifstream >> std::size_t` extracted
/// 0 without consuming the digits ("MemTotal:", 0, "131961788"), so both fields read 0, every
/// background pinning sweep saw no room and waited for good, and pools never grew past their
/// first chunk (the same binary's GoogleTests parsed the file correctly).
std::optional<HostMemory> read_host_memory();

/// Bytes a pool pinned ahead of need leaves free (HostAllocator::room_for): max(1 GiB, 1/32 of the
/// RAM).
std::size_t host_memory_reserve(const HostMemory& m);

/// One line for logs and stats: "12.3 GiB available of 125.8 GiB".
std::string describe(const HostMemory& m);

}  // namespace hicache
