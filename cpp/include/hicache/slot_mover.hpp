#pragma once
// SlotMover: the copier half of hicache. Copies pages between the engine's blocks and host
// slots named by the caller (a BlockCatalog's slots), as jobs that complete asynchronously.
//
// Each engine process (each tensor-parallel rank, each vLLM worker) makes one over its own KV
// segments. The slots' memory is its own pool, or a shared region that several processes map
// (shared_region.hpp): then a slot written by one process is read by any other.

#include <cstdint>
#include <functional>
#include <list>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include "hicache/copier.hpp"
#include "hicache/host_pool.hpp"
#include "hicache/page_layout.hpp"

namespace hicache {

class SlotMover {
 public:
  struct Result {
    std::int64_t job = 0;
    bool ok = false;
  };

  /// @param num_slots the pool's slots, one page (layout's page bytes) each.
  /// @param copier nullptr: the CPU copier for CPU segments, the CUDA copier for CUDA ones.
  /// @param memory where slots live; nullptr: the copier's own (pinned for CUDA).
  /// @param pin_in_background memory that is slow to allocate (pinned) is allocated chunk after
  ///        chunk by a background thread from construction on, and a slot whose chunk is not
  ///        there yet has no address (slot_address() is nullptr); false: all of it at once.
  /// @param slot_extra_bytes room after each slot's page that copies never touch (a cache with
  ///        a tier writes the page's record there, so a value goes to the tier straight from
  ///        the slot).
  /// @param wrap_memory if set, given the memory slots come from (pinned, for CUDA) and returns
  ///        what the pool uses instead (a cache with a tier registers each chunk with it).
  /// @param slot_align an alignment slots take where it costs little (HostPool's wanted_align:
  ///        a tier's value_alignment).
  /// @throws std::invalid_argument for a bad layout or segments the copier cannot reach.
  SlotMover(std::vector<Segment> segments, Device device, std::int64_t num_slots,
            std::shared_ptr<Copier> copier = nullptr,
            std::shared_ptr<HostAllocator> memory = nullptr,
            std::size_t chunk_bytes = std::size_t{1} << 30, bool pin_in_background = false,
            std::size_t slot_extra_bytes = 0,
            const std::function<std::shared_ptr<HostAllocator>(std::shared_ptr<HostAllocator>)>&
                wrap_memory = {},
            std::size_t slot_align = 0);
  /// Waits for every job in flight.
  ~SlotMover();
  SlotMover(const SlotMover&) = delete;
  SlotMover& operator=(const SlotMover&) = delete;

  /// Enqueues on `stream` the copy of page slots[i] <-> block blocks[i] for every i, in `dir`.
  /// @return the job's id (> 0).
  /// @throws std::invalid_argument (lengths differ, a repeated destination), std::out_of_range
  ///         (a slot or block id out of range): nothing is enqueued then. hicache::Error if the
  ///         copy cannot be enqueued.
  std::int64_t submit(Direction dir, std::span<const std::int64_t> slots,
                      std::span<const std::int64_t> blocks, StreamHandle stream = nullptr);
  /// Jobs completed since the last call (a device failure reports ok = false). Non-blocking.
  std::vector<Result> finished();
  /// Blocks until the given jobs completed (they are then reported by finished()).
  void wait(std::span<const std::int64_t> jobs);

  const PageLayout& layout() const { return layout_; }
  std::int64_t num_slots() const { return pool_->num_slots(); }
  const char* copy_path() const { return copier_->path(); }
  /// Address of a slot's page (the bytes are the segments' blocks concatenated): nullptr while
  /// its memory is being pinned in the background. @throws hicache::Error if that failed.
  std::byte* slot_address(std::int64_t slot) { return pool_->slot(slot); }

  /// For a front end that tracks completion itself (HostPrefixCache: a transfer of pages and
  /// state under one fence): the copier, bound to the layout, and the pool.
  Copier& copier() { return *copier_; }
  const Copier& copier() const { return *copier_; }
  HostPool& pool() { return *pool_; }
  const HostPool& pool() const { return *pool_; }
  /// Enqueues page copies between host addresses (of this pool's slots) and blocks, without a
  /// job. @throws as Copier::copy_pages.
  void copy(Direction dir, std::span<const PageMove> moves, StreamHandle stream) {
    if (layout_.page_bytes() > 0) copier_->copy_pages(dir, layout_, moves, stream);
  }

 private:
  struct Job {
    std::int64_t id;
    std::unique_ptr<Fence> fence;
    bool done = false;
    bool ok = true;
  };
  void poll_locked();

  PageLayout layout_;
  std::shared_ptr<Copier> copier_;
  std::unique_ptr<HostPool> pool_;
  std::mutex mu_;
  std::list<Job> jobs_;
  std::int64_t next_job_ = 1;
};

}  // namespace hicache
