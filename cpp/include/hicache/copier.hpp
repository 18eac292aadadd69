#pragma once
// The copier: moves pages between the engine's blocks and host slots, in one direction a batch.
//
// A copier enqueues work on the caller's stream and reports completion through a Fence recorded
// after it. The CPU copier copies at once; the CUDA copier launches one gather/scatter kernel.

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>

#include "hicache/device.hpp"
#include "hicache/host_pool.hpp"
#include "hicache/page_layout.hpp"

namespace hicache {

enum class Direction { kToHost, kToDevice };

/// One page of a batch: the engine block and the host slot address.
struct PageMove {
  std::int64_t block = 0;
  std::byte* host = nullptr;
  /// When not null, a copier that sums pages (Copier::sums_pages: the CPU copier) sets it to the
  /// page's checksum (page_checksum of its host bytes, tier_record.hpp) as it copies it, either
  /// way: a cache with a tier then need not read the page again to write it there (stores) or to
  /// check a page fetched from there (loads). Others leave it alone.
  std::optional<std::uint64_t>* checksum = nullptr;
  /// When not null, a copier that sums pages on the device (Copier::sums_on_device: the CUDA
  /// copier) has the device write the page's checksum here as part of copy_pages: a store's of
  /// the engine's block as it is copied out, a load's of the block once the copy has landed in
  /// it. It is there once a fence recorded on the stream after copy_pages is done. Memory the
  /// device can write: the copier's host_allocator()'s. A cache with a tier then need not read
  /// the page on the CPU before it puts it there, nor to check a page it fetched from there.
  std::uint64_t* sum_at_fence = nullptr;
};

/// Completion marker of everything enqueued on a stream before it was recorded.
class Fence {
 public:
  virtual ~Fence() = default;
  /// Non-blocking. @throws hicache::Error if the device reports a failure.
  virtual bool done() = 0;
  /// Blocks until done; never throws (used on teardown).
  virtual void wait() noexcept = 0;
  /// Makes work enqueued on `stream` after this call wait for the fence, without blocking the
  /// caller where the device can (a CUDA event wait); by default the caller blocks until done.
  /// @throws hicache::Error if the device refuses the wait.
  virtual void enqueue_wait(StreamHandle stream) {
    (void)stream;
    wait();
  }
};

class Copier {
 public:
  virtual ~Copier() = default;

  /// Called once by the cache with its layout before any copy: a copier may validate the
  /// segments (device, alignment) and prepare what it needs. @throws std::invalid_argument.
  virtual void bind(const PageLayout& layout) { (void)layout; }

  /// Enqueues copies of whole pages. Block ids were checked by the caller.
  /// @throws hicache::Error if the copy cannot be enqueued.
  virtual void copy_pages(Direction dir, const PageLayout& layout, std::span<const PageMove> moves,
                          StreamHandle stream) = 0;

  /// Enqueues copies of segments [first, last) of whole pages (the bytes of one layer, for
  /// layer-wise loads): the host side is each page's bytes [page_offset(first), page_offset(last))
  /// at the same place as in a whole-page copy. The default takes only the whole page.
  /// @throws hicache::Error if the copy cannot be enqueued (or this copier copies whole pages
  /// only).
  virtual void copy_segments(Direction dir, const PageLayout& layout,
                             std::span<const PageMove> moves, std::size_t first, std::size_t last,
                             StreamHandle stream);

  /// Enqueues one contiguous copy between an engine buffer and host memory (state slots).
  /// @throws hicache::Error if the copy cannot be enqueued.
  virtual void copy_bytes(Direction dir, const DeviceBuffer& engine_buffer, std::byte* host,
                          StreamHandle stream) = 0;

  /// A fence after all work enqueued so far on `stream`. @throws hicache::Error.
  virtual std::unique_ptr<Fence> record(StreamHandle stream) = 0;

  /// Where host slots come from (plain for the CPU copier, pinned for the CUDA copier).
  virtual std::shared_ptr<HostAllocator> host_allocator() = 0;

  /// Whether engine memory on `device` can be reached by this copier.
  virtual bool supports(Device device) const = 0;

  /// Bytes a second of recent loads (host to engine), as this copier measured them (a decayed
  /// average weighted by bytes, competing traffic included); 0 until one was measured.
  virtual double load_bytes_per_s() const { return 0.0; }

  /// Whether copy_pages sets PageMove::checksum for pages of `layout`, both ways, before it
  /// returns (the CPU copier, for layouts whose segments are whole kilobytes but the last).
  virtual bool sums_pages(const PageLayout& layout) const {
    (void)layout;
    return false;
  }

  /// Whether copy_pages writes PageMove::sum_at_fence for pages of `layout`, both ways (the CUDA
  /// copier, once bound to it, for layouts whose segments are whole kilobytes but the last).
  virtual bool sums_on_device(const PageLayout& layout) const {
    (void)layout;
    return false;
  }

  /// Whether copy_pages moves consecutive pages of `layout` whose host slots and engine blocks
  /// both follow each other (or both precede each other) as one copy, which costs less than a
  /// copy a page (the CUDA copier's DMA path on one-segment pages, once bound). A cache then
  /// gives a store's new pages its host slots in the order of their blocks.
  virtual bool joins_runs(const PageLayout& layout) const {
    (void)layout;
    return false;
  }

  /// How pages move, for users and logs: "cpu", "deferred", "null"; the CUDA copier, once
  /// bound: "dma", "staged" or "kernel".
  virtual const char* path() const = 0;
};

}  // namespace hicache
