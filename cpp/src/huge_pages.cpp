#include "huge_pages.hpp"

#include <sys/mman.h>

#include <cstdint>
#include <string>

#include "hicache/error.hpp"

namespace hicache::detail {

namespace {
constexpr std::size_t kPage = 4096;
std::size_t whole_pages(std::size_t bytes) { return (bytes + kPage - 1) / kPage * kPage; }
}  // namespace

void* map_huge_aligned(std::size_t size) {
  const std::size_t bytes = whole_pages(size);
  void* raw =
      mmap(nullptr, bytes + kHugePage, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (raw == MAP_FAILED) throw Error("mmap of " + std::to_string(size) + " bytes failed");
  const auto base = reinterpret_cast<std::uintptr_t>(raw);
  const std::uintptr_t aligned = (base + kHugePage - 1) & ~(kHugePage - 1);
  // Give back what lies before the boundary and after the memory (together, the extra 2 MiB).
  if (aligned > base) munmap(raw, aligned - base);
  const std::uintptr_t tail = base + kHugePage - aligned;
  munmap(reinterpret_cast<void*>(aligned + bytes), tail);  // never empty: aligned < base + 2 MiB
  void* p = reinterpret_cast<void*>(aligned);
  madvise(p, bytes, MADV_HUGEPAGE);  // best effort: 4 KiB pages where refused
  return p;
}

void unmap_huge_aligned(void* p, std::size_t size) noexcept { munmap(p, whole_pages(size)); }

}  // namespace hicache::detail
