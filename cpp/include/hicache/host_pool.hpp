#pragma once
// Fixed-size host slots, allocated in chunks.
//
// A pool of N slots never allocates N * slot_bytes at once, and its bookkeeping grows with the
// chunks in use, never with N: an idle cache of any capacity costs a few bytes. Slots are rounded
// up to 256 bytes (alignment for vector copies), never to a power of two; to a larger alignment
// a tier asks for (Tier::value_alignment: a disk's direct I/O reads into a slot only if it is
// aligned to 4096) where that adds at most 1/64 to a slot.
//
// Growth modes:
//  - kOnDemand: the chunk holding a slot is allocated by the first slot() call in it (CPU pools,
//    where allocation is cheap).
//  - kBackground: for slow allocators (pinning runs at about 10-13 GB/s, so a 1 GiB chunk takes
//    ~80 ms that the engine's thread must not pay). The constructor allocates the first chunk; a
//    background thread then allocates the others, in slot order, one after another, until the
//    pool is whole, so a pool is all there within seconds of start-up instead of growing one
//    chunk per burst of stores. It pauses while the allocator reports too little host memory
//    left (HostAllocator::room_for), looking again every 200 ms, and stops after a failed
//    allocation until an allocation succeeds again; a chunk whose slot is asked for is allocated
//    meanwhile all the same. slot() never blocks: it returns nullptr while its chunk is not there
//    yet, and the cache skips that store (counted). status() says which of these the pool is
//    doing, and why it waits or stopped. Pinning does not wait for the GPU (measured on an
//    H200: 48 ms for 256 MiB while a 100 ms kernel ran, 51 ms idle).
//  - kUpFront: every chunk is allocated by the constructor (predictable, nothing left to pin).

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace hicache {

/// Source of host memory for a pool: plain page-aligned memory for the CPU copier, pinned and
/// mapped memory for the CUDA copier.
class HostAllocator {
 public:
  virtual ~HostAllocator() = default;
  /// @throws hicache::Error if the memory cannot be had.
  virtual void* allocate(std::size_t bytes) = 0;
  virtual void deallocate(void* p, std::size_t bytes) noexcept = 0;
  virtual const char* name() const = 0;
  /// Whether allocate() is slow enough to keep off the engine's thread (pinning: about 50 ms per
  /// 256 MiB on an H200 host); such pools are allocated on a background thread.
  virtual bool allocation_is_slow() const { return false; }
  /// Whether `bytes` more can be allocated ahead of need without starving the machine: pinned
  /// memory cannot be swapped, so a pool pinned in the background pauses while this is false.
  /// Default: at least max(1 GiB, 1/32 of the RAM) would stay available after it (Linux
  /// /proc/meminfo; true where that cannot be read).
  virtual bool room_for(std::size_t bytes) const;
  /// What room_for knows of the machine's memory, one line, for a pool's status while it waits
  /// ("12.3 GiB available of 125.8 GiB, 3.9 GiB kept free").
  virtual std::string memory_report() const;
};

/// Page-aligned memory: chunks of 2 MiB and more mapped on transparent huge pages where the kernel
/// gives them (madvise), smaller ones from the C++ runtime's aligned_alloc.
std::shared_ptr<HostAllocator> make_aligned_host_allocator();

class HostPool {
 public:
  static constexpr std::size_t kSlotAlign = 256;
  /// In a pool of several chunks, bytes each chunk's allocation holds after its last slot, never
  /// handed out, so that no slot of one chunk ends where a slot of another begins, whatever the
  /// allocator and however the kernel lays out mappings (a bottom-up layout, as under `ulimit -s
  /// unlimited`, puts a mapping right after the one before). Copiers join a call's slots that
  /// follow each other into one DMA piece (the staged path; a call's slots are one pool's), and
  /// a piece must not span two pinned registrations. A pool of one chunk (a shared region's)
  /// allocates its bytes alone. The cost: a chunk whose slots fill whole huge pages maps one
  /// more (2 MiB a 1 GiB chunk, 0.2 %).
  static constexpr std::size_t kChunkGap = kSlotAlign;
  enum class Growth { kOnDemand, kBackground, kUpFront };

  /// What a pool's memory is doing.
  enum class Pinning {
    kOnDemand,          ///< allocated chunk by chunk as slots are first used (fast allocators)
    kWhole,             ///< every chunk is allocated
    kPinning,           ///< the background thread allocates the rest, chunk after chunk
    kWaitingForMemory,  ///< paused: too little host memory left (HostAllocator::room_for)
    kStopped,           ///< paused after a failed allocation, until one succeeds again
  };
  static const char* name(Pinning p);
  struct Status {
    std::size_t allocated_bytes = 0;
    std::size_t total_bytes = 0;  ///< the whole pool
    Pinning pinning = Pinning::kOnDemand;
    /// Why it waits, or the last failed allocation (it may have succeeded when asked again);
    /// empty if neither.
    std::string note;
  };
  /// Memory that is fast to allocate grows on demand; slow (pinned) memory is allocated in the
  /// background from construction on, or all of it up front.
  static Growth growth_for(const HostAllocator& memory, bool in_background) {
    if (!memory.allocation_is_slow()) return Growth::kOnDemand;
    return in_background ? Growth::kBackground : Growth::kUpFront;
  }

  /// @param chunk_bytes target size of one allocation; a chunk holds at least one slot.
  /// @param wanted_align an alignment (a power of two) slots take if it adds at most 1/64 to a
  ///        slot; 0 or below kSlotAlign: kSlotAlign.
  /// @throws std::invalid_argument for zero sizes or an alignment that is not a power of two;
  ///         hicache::Error if kBackground or kUpFront cannot allocate what the constructor
  ///         allocates.
  HostPool(std::size_t slot_bytes, std::int64_t num_slots, std::size_t chunk_bytes,
           std::shared_ptr<HostAllocator> allocator, Growth growth = Growth::kOnDemand,
           std::size_t wanted_align = 0);
  ~HostPool();
  HostPool(const HostPool&) = delete;
  HostPool& operator=(const HostPool&) = delete;

  /// Address of slot i. kOnDemand: allocates its chunk on first use. kBackground: nullptr while
  /// the chunk is not allocated yet (it is then asked for, if the background thread had stopped).
  /// @throws std::out_of_range for i outside [0, num_slots); hicache::Error if allocation failed
  ///         (kBackground: the failure of the background attempt, reported once; a later call
  ///         asks again).
  std::byte* slot(std::int64_t i);

  /// Blocks until the background thread has nothing left to do: every chunk allocated, or it
  /// stopped (a failure, too little host memory) with no chunk asked for (tests, benchmarks).
  void wait_idle();

  std::size_t slot_bytes() const { return slot_bytes_; }
  std::size_t slot_stride() const { return slot_stride_; }
  /// Every slot's address is a multiple of this (where the allocator's chunks are page-aligned,
  /// as every allocator here hands them out).
  std::size_t slot_align() const { return slot_align_; }
  std::int64_t num_slots() const { return num_slots_; }
  std::size_t allocated_bytes() const;
  /// The pool's bytes once whole.
  std::size_t total_bytes() const;
  /// A snapshot of what the pool's memory is doing. Takes the pool's lock; reads no file.
  Status status() const;
  const HostAllocator& allocator() const { return *allocator_; }

 private:
  enum class State { kNone, kRequested, kReady, kFailed };
  struct Chunk {
    std::byte* data = nullptr;
    State state = State::kNone;
    std::string failure;
  };
  std::size_t chunk_size(std::size_t c) const;  // its slots' bytes
  std::size_t allocation_size(std::size_t c) const {
    return chunk_size(c) + (num_chunks_ > 1 ? kChunkGap : 0);
  }
  Chunk& chunk(std::size_t c);       // grows chunks_ to hold c; caller holds mu_
  void allocate_now(std::size_t c);  // caller holds mu_
  void ready(Chunk& ch, std::byte* data, std::size_t bytes);  // caller holds mu_
  void request(std::size_t c);                                // caller holds mu_
  bool next_job(std::size_t& c);  // caller holds mu_: the chunk the thread pins next
  void start_thread();            // caller holds mu_
  void worker();

  std::size_t slot_bytes_;
  std::size_t slot_stride_;
  std::size_t slot_align_ = kSlotAlign;
  std::int64_t num_slots_;
  std::int64_t slots_per_chunk_;
  std::size_t num_chunks_;
  std::shared_ptr<HostAllocator> allocator_;
  Growth growth_;

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::vector<Chunk> chunks_;  // [0, highest chunk touched]; never sized from num_slots
  std::size_t allocated_bytes_ = 0;
  std::size_t ready_chunks_ = 0;
  std::atomic<bool> whole_{false};  // every chunk is allocated (set once, under mu_)
  std::vector<std::size_t> queue_;  // chunks asked for by slot(), pinned first
  std::size_t sweep_next_ = 1;      // kBackground: next chunk the sweep pins
  bool sweep_stopped_ = false;      // kBackground: an allocation failed: pin only when asked
  bool sweep_waiting_ = false;      // kBackground: too little host memory now; look again soon
  std::string waiting_note_;        // why it waits (the allocator's memory report)
  std::string last_failure_;        // the last failed allocation's error
  bool stopping_ = false;
  bool busy_ = false;
  std::thread thread_;
};

}  // namespace hicache
