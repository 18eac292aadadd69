#pragma once
// A named shared-memory region (/dev/shm) holding host slots that several processes of one
// engine map: the copier half of hicache in each worker, the catalog naming the slots elsewhere.
//
// A region belongs to one owner (the catalog whose slot numbers give its bytes meaning). Its
// first 4 KiB are a header: owner, slot layout, and the creating process (pid and start time).
// Exactly one process creates a region (O_EXCL); others attach only when they name the same
// owner and layout and the creator is alive, and are refused with an error saying what differs
// otherwise, so two engines can never share slots by accident. A creator removes its region's
// name when the region is freed, at exit, and on SIGTERM or SIGHUP; regions left by a process
// that was killed (SIGKILL, os._exit) are found by their dead creator and removed whenever a
// region is created, and by reclaim_shared_regions(). Memory is returned to the machine once the
// name is gone and the last process unmapped it.

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "hicache/host_pool.hpp"

namespace hicache {

struct SharedRegion {
  /// The file's name under /dev/shm: 1-200 bytes, no '/'. hicache's own start with "hicache-".
  std::string name;
  /// Create the region (refused if a live process holds that name; a dead one's is replaced), or
  /// attach to one another process created.
  bool create = true;
  /// Who the slots belong to (the catalog naming them); an attacher must name the same owner.
  std::string owner;
  /// The slots' layout (page bytes, slots); an attacher must name the same layout.
  std::string layout;
  /// How long an attacher waits for the creator to make the region ready.
  double attach_timeout_s = 60.0;
};

/// Host memory in a shared region, mapped by the pool's first allocation (give HostPool a chunk
/// at least the pool's size). Pages are not touched until used.
/// @throws std::invalid_argument for a bad name; the allocation throws hicache::Error naming the
///         region and what refused it (another owner, another layout, a live holder, a dead
///         creator, a timeout).
std::shared_ptr<HostAllocator> make_shared_region_allocator(SharedRegion region);

/// Removes every hicache region under /dev/shm whose creator is no longer running. Safe beside
/// live engines: their regions are left alone, and a removed name only stops new attachments
/// (processes that still map the region keep it until they unmap it).
/// @return the names removed.
std::vector<std::string> reclaim_shared_regions();

}  // namespace hicache
