#pragma once
// Minimal unkeyed BLAKE2b (RFC 7693), incremental. Private to the core: the public concept is the
// hash chain (hicache/hash_chain.hpp).

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace hicache::detail {

class Blake2b {
 public:
  /// @param digest_bytes 1..64
  explicit Blake2b(std::size_t digest_bytes);
  void update(const void* data, std::size_t n);
  /// Promises that more input follows: a full buffered block is compressed now instead of at
  /// the next update (so a state made of whole blocks can be copied and finished later with
  /// different endings, each costing only its own blocks).
  void more_follows();
  /// Writes digest_bytes bytes to out. The object must not be updated afterwards.
  void finish(std::uint8_t* out);
  /// Four independent messages at once, each `state[l]->update(data[l], n)` then
  /// `more_follows()`: their whole blocks are compressed side by side, one message a 64-bit
  /// lane of a vector (AVX2 or AVX-512VL where the CPU has them: on this project's 2-core CPU
  /// machine 51.5 and 46 ns a message's block, against 138 for one message at a time), and the
  /// rest of each is buffered. Every state must hold whole blocks only, the same number of them
  /// (fresh states do).
  static void update4(Blake2b* const state[4], const std::uint8_t* const data[4], std::size_t n);

 private:
  void compress(const std::uint8_t* block, bool last);
  void count(std::size_t n);  // the byte counter t

  std::uint64_t h_[8];
  std::uint64_t t_[2] = {0, 0};
  std::uint8_t buf_[128];
  std::size_t buf_len_ = 0;
  std::size_t digest_bytes_;
};

/// The four-lane kernels (update4) this CPU can run, narrowest first ("baseline", then "avx2",
/// "avx512" on x86-64 CPUs that have them). update4 uses the last one.
std::vector<std::string> four_lane_kernels();
/// For tests and benchmarks: makes update4 use the kernel `name` (one of four_lane_kernels()),
/// process-wide, and returns the one it used before.
/// @throws std::invalid_argument if this CPU has no such kernel.
std::string use_four_lane_kernel(const std::string& name);

}  // namespace hicache::detail
