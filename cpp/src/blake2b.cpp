#include "blake2b.hpp"

#include <atomic>
#include <bit>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

namespace hicache::detail {
namespace {

constexpr std::uint64_t kIv[8] = {
    0x6a09e667f3bcc908ULL, 0xbb67ae8584caa73bULL, 0x3c6ef372fe94f82bULL, 0xa54ff53a5f1d36f1ULL,
    0x510e527fade682d1ULL, 0x9b05688c2b3e6c1fULL, 0x1f83d9abfb41bd6bULL, 0x5be0cd19137e2179ULL};

constexpr std::uint8_t kSigma[12][16] = {{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15},
                                         {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3},
                                         {11, 8, 12, 0, 5, 2, 15, 13, 10, 14, 3, 6, 7, 1, 9, 4},
                                         {7, 9, 3, 1, 13, 12, 11, 14, 2, 6, 5, 10, 4, 0, 15, 8},
                                         {9, 0, 5, 7, 2, 4, 10, 15, 14, 1, 11, 12, 6, 8, 3, 13},
                                         {2, 12, 6, 10, 0, 11, 8, 3, 4, 13, 7, 5, 15, 14, 1, 9},
                                         {12, 5, 1, 15, 14, 13, 4, 10, 0, 7, 6, 3, 9, 2, 8, 11},
                                         {13, 11, 7, 14, 12, 1, 3, 9, 5, 0, 15, 4, 8, 6, 2, 10},
                                         {6, 15, 14, 9, 11, 3, 0, 8, 12, 2, 13, 7, 1, 4, 10, 5},
                                         {10, 2, 8, 4, 7, 6, 1, 5, 15, 11, 9, 14, 3, 12, 13, 0},
                                         {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15},
                                         {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3}};

inline std::uint64_t load_le64(const std::uint8_t* p) {
  if constexpr (std::endian::native == std::endian::little) {
    std::uint64_t v;  // one load (the byte loop below compiled to 250 vector instructions)
    std::memcpy(&v, p, sizeof v);
    return v;
  } else {
    std::uint64_t v = 0;
    for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
    return v;
  }
}

// Four messages' compressions side by side: lane l of every vector belongs to message l. GCC's
// and clang's vector extensions map a vector of four 64-bit words onto one AVX2 register, or
// onto two SSE2 or NEON registers elsewhere (still four independent chains for the core to
// overlap).
using Lanes = std::uint64_t __attribute__((vector_size(32)));
using LaneBytes = std::uint8_t __attribute__((vector_size(32)));

// How a rotation of four lanes is written. Shifts: two shifts and an or, which every target
// has. Bytes: the rotations by whole bytes (32, 24, 16) as one byte shuffle within each 64-bit
// word (vpshufb on AVX2); with AVX-512VL the compiler makes the shifts' rotation (by 63) one
// vprorq too. A rotation was 3 of every 5 instructions of the AVX2 kernel's rounds.
enum class Rotate { kShifts, kBytes };

// x rotated right by 8 * K bits, each 64-bit lane alone: byte i of a little-endian word takes
// byte (i + K) mod 8. By reference, as xor_rotr below. GCC's __builtin_shuffle (its
// __builtin_shufflevector is GCC 12's and later) and clang's __builtin_shufflevector take the
// same byte indices.
template <int K>
[[gnu::always_inline]] inline void rotr_bytes(Lanes& out, const Lanes& x) {
  LaneBytes b;
  std::memcpy(&b, &x, sizeof b);
#define HICACHE_ROTR_WORD(w)                                                                  \
  8 * (w) + (0 + K) % 8, 8 * (w) + (1 + K) % 8, 8 * (w) + (2 + K) % 8, 8 * (w) + (3 + K) % 8, \
      8 * (w) + (4 + K) % 8, 8 * (w) + (5 + K) % 8, 8 * (w) + (6 + K) % 8, 8 * (w) + (7 + K) % 8
#if defined(__clang__)
  const LaneBytes r = __builtin_shufflevector(b, b, HICACHE_ROTR_WORD(0), HICACHE_ROTR_WORD(1),
                                              HICACHE_ROTR_WORD(2), HICACHE_ROTR_WORD(3));
#else
  constexpr LaneBytes order = {HICACHE_ROTR_WORD(0), HICACHE_ROTR_WORD(1), HICACHE_ROTR_WORD(2),
                               HICACHE_ROTR_WORD(3)};
  const LaneBytes r = __builtin_shuffle(b, order);
#endif
#undef HICACHE_ROTR_WORD
  std::memcpy(&out, &r, sizeof out);
}

// The twelve rounds over the working vector v and message m, for one message (W = uint64_t) or
// four side by side (W = Lanes: the same shifts act lane by lane). Unrolled, every message word's
// index is a constant: ~25 % faster a block than the loop.
// d = (d ^ a) rotated right by n. By reference: a vector passed by value would change the ABI
// between builds with and without AVX (-Wpsabi).
template <Rotate R, int N, class W>
[[gnu::always_inline]] inline void xor_rotr(W& d, const W& a) {
  const W x = d ^ a;
  if constexpr (R == Rotate::kBytes && N % 8 == 0) {
    rotr_bytes<N / 8>(d, x);
  } else {
    d = (x >> N) | (x << (64 - N));
  }
}

template <Rotate R, class W>
[[gnu::always_inline]] inline void mix(W* v, int a, int b, int c, int d, const W& x, const W& y) {
  v[a] = v[a] + v[b] + x;
  xor_rotr<R, 32>(v[d], v[a]);
  v[c] = v[c] + v[d];
  xor_rotr<R, 24>(v[b], v[c]);
  v[a] = v[a] + v[b] + y;
  xor_rotr<R, 16>(v[d], v[a]);
  v[c] = v[c] + v[d];
  xor_rotr<R, 63>(v[b], v[c]);
}

template <Rotate R = Rotate::kShifts, class W>
[[gnu::always_inline]] inline void rounds(W* v, const W* m) {
#pragma GCC unroll 12
  for (const auto& s : kSigma) {
    mix<R>(v, 0, 4, 8, 12, m[s[0]], m[s[1]]);
    mix<R>(v, 1, 5, 9, 13, m[s[2]], m[s[3]]);
    mix<R>(v, 2, 6, 10, 14, m[s[4]], m[s[5]]);
    mix<R>(v, 3, 7, 11, 15, m[s[6]], m[s[7]]);
    mix<R>(v, 0, 5, 10, 15, m[s[8]], m[s[9]]);
    mix<R>(v, 1, 6, 11, 12, m[s[10]], m[s[11]]);
    mix<R>(v, 2, 7, 8, 13, m[s[12]], m[s[13]]);
    mix<R>(v, 3, 4, 9, 14, m[s[14]], m[s[15]]);
  }
}

// One block of each message (little-endian hosts only: the words are loaded as they lie), with
// the byte count t after it (the same for all four) and not the last block.
template <Rotate R>
[[gnu::always_inline]] inline void compress4_body(std::uint64_t (&h)[8][4],
                                                  const std::uint8_t* const block[4],
                                                  std::uint64_t t0, std::uint64_t t1) {
  Lanes m[16];
  for (int i = 0; i < 16; ++i) {
    for (int l = 0; l < 4; ++l) {
      std::uint64_t word;
      std::memcpy(&word, block[l] + 8 * i, sizeof word);
      m[i][l] = word;
    }
  }
  Lanes v[16];
  for (int i = 0; i < 8; ++i) {
    std::memcpy(&v[i], h[i], sizeof v[i]);
    v[i + 8] = Lanes{kIv[i], kIv[i], kIv[i], kIv[i]};
  }
  v[12] ^= Lanes{t0, t0, t0, t0};
  v[13] ^= Lanes{t1, t1, t1, t1};
  rounds<R>(v, m);
  for (int i = 0; i < 8; ++i) {
    Lanes hi;
    std::memcpy(&hi, h[i], sizeof hi);
    hi ^= v[i] ^ v[i + 8];
    std::memcpy(h[i], &hi, sizeof hi);
  }
}

using Compress4 = void (*)(std::uint64_t (&)[8][4], const std::uint8_t* const[4], std::uint64_t,
                           std::uint64_t);

// The same code built for each vector width, chosen at run time (not by an ifunc resolver:
// ThreadSanitizer builds crash in one, as it runs before the sanitizer is set up).
#if defined(__x86_64__)
[[gnu::target("avx2")]] void compress4_avx2(std::uint64_t (&h)[8][4],
                                            const std::uint8_t* const block[4], std::uint64_t t0,
                                            std::uint64_t t1) {
  compress4_body<Rotate::kBytes>(h, block, t0, t1);
}
[[gnu::target("avx2,avx512f,avx512vl")]] void compress4_avx512(std::uint64_t (&h)[8][4],
                                                               const std::uint8_t* const block[4],
                                                               std::uint64_t t0, std::uint64_t t1) {
  compress4_body<Rotate::kBytes>(h, block, t0, t1);
}
#endif

// SSE2 has no byte shuffle (its two registers a vector take the shifts); NEON's tbl would do the
// bytes, but no ARM machine measured it.
void compress4_baseline(std::uint64_t (&h)[8][4], const std::uint8_t* const block[4],
                        std::uint64_t t0, std::uint64_t t1) {
  compress4_body<Rotate::kShifts>(h, block, t0, t1);
}

struct Kernel4 {
  const char* name;
  Compress4 fn;
  bool available;
};

std::vector<Kernel4> kernels4() {
  std::vector<Kernel4> k{{"baseline", compress4_baseline, true}};
#if defined(__x86_64__)
  __builtin_cpu_init();
  k.push_back({"avx2", compress4_avx2, __builtin_cpu_supports("avx2") != 0});
  k.push_back({"avx512", compress4_avx512,
               __builtin_cpu_supports("avx2") != 0 && __builtin_cpu_supports("avx512f") != 0 &&
                   __builtin_cpu_supports("avx512vl") != 0});
#endif
  return k;
}

// The widest kernel this CPU runs, unless a test chose one (use_four_lane_kernel). A function's
// static, so that a key hashed while another file's statics are initialized finds it set.
std::atomic<Compress4>& chosen4() {
  static std::atomic<Compress4> chosen = [] {
    Compress4 best = compress4_baseline;
    for (const Kernel4& k : kernels4()) {
      if (k.available) best = k.fn;
    }
    return best;
  }();
  return chosen;
}

void compress4(std::uint64_t (&h)[8][4], const std::uint8_t* const block[4], std::uint64_t t0,
               std::uint64_t t1) {
  chosen4().load(std::memory_order_relaxed)(h, block, t0, t1);
}

}  // namespace

std::vector<std::string> four_lane_kernels() {
  std::vector<std::string> names;
  for (const Kernel4& k : kernels4()) {
    if (k.available) names.emplace_back(k.name);
  }
  return names;
}

std::string use_four_lane_kernel(const std::string& name) {
  const std::vector<Kernel4> kernels = kernels4();
  std::string was;
  for (const Kernel4& k : kernels) {
    if (k.fn == chosen4().load()) was = k.name;
  }
  for (const Kernel4& k : kernels) {
    if (k.name == name && k.available) {
      chosen4().store(k.fn);
      return was;
    }
  }
  throw std::invalid_argument("blake2b: no four-lane kernel '" + name + "' on this CPU");
}

void Blake2b::update4(Blake2b* const state[4], const std::uint8_t* const data[4], std::size_t n) {
  const std::size_t whole = n / sizeof buf_;
  bool lanes = std::endian::native == std::endian::little && whole > 0;
  for (int l = 0; l < 4; ++l) {
    const Blake2b& s = *state[l];
    lanes = lanes && s.buf_len_ == 0 && s.t_[0] == state[0]->t_[0] && s.t_[1] == state[0]->t_[1];
  }
  if (!lanes) {  // a state mid-block, or a big-endian host: one message at a time
    for (int l = 0; l < 4; ++l) {
      state[l]->update(data[l], n);
      state[l]->more_follows();
    }
    return;
  }
  std::uint64_t h[8][4];
  for (int i = 0; i < 8; ++i) {
    for (int l = 0; l < 4; ++l) h[i][l] = state[l]->h_[i];
  }
  for (std::size_t b = 0; b < whole; ++b) {
    for (int l = 0; l < 4; ++l) state[l]->count(sizeof buf_);
    const std::uint8_t* block[4];
    for (int l = 0; l < 4; ++l) block[l] = data[l] + b * sizeof buf_;
    compress4(h, block, state[0]->t_[0], state[0]->t_[1]);
  }
  for (int l = 0; l < 4; ++l) {
    for (int i = 0; i < 8; ++i) state[l]->h_[i] = h[i][l];
    state[l]->update(data[l] + whole * sizeof buf_, n % sizeof buf_);
  }
}

Blake2b::Blake2b(std::size_t digest_bytes) : digest_bytes_(digest_bytes) {
  if (digest_bytes < 1 || digest_bytes > 64) throw std::invalid_argument("blake2b: digest 1..64");
  std::memcpy(h_, kIv, sizeof h_);
  // Parameter block: digest length, no key, fanout 1, depth 1.
  h_[0] ^= 0x01010000ULL ^ static_cast<std::uint64_t>(digest_bytes);
}

void Blake2b::compress(const std::uint8_t* block, bool last) {
  std::uint64_t m[16];
  for (int i = 0; i < 16; ++i) m[i] = load_le64(block + 8 * i);
  std::uint64_t v[16];
  for (int i = 0; i < 8; ++i) {
    v[i] = h_[i];
    v[i + 8] = kIv[i];
  }
  v[12] ^= t_[0];
  v[13] ^= t_[1];
  if (last) v[14] = ~v[14];
  rounds(v, m);
  for (int i = 0; i < 8; ++i) h_[i] ^= v[i] ^ v[i + 8];
}

void Blake2b::update(const void* data, std::size_t n) {
  const auto* p = static_cast<const std::uint8_t*>(data);
  while (n > 0) {
    // The last block must be compressed with the final flag, so a full buffer is only flushed
    // once more input arrives.
    if (buf_len_ == sizeof buf_) more_follows();
    // Whole blocks with more input after them are compressed in place, not through the buffer.
    while (buf_len_ == 0 && n > sizeof buf_) {
      count(sizeof buf_);
      compress(p, false);
      p += sizeof buf_;
      n -= sizeof buf_;
    }
    std::size_t take = sizeof buf_ - buf_len_;
    if (take > n) take = n;
    std::memcpy(buf_ + buf_len_, p, take);
    buf_len_ += take;
    p += take;
    n -= take;
  }
}

void Blake2b::more_follows() {
  if (buf_len_ != sizeof buf_) return;
  count(sizeof buf_);
  compress(buf_, false);
  buf_len_ = 0;
}

void Blake2b::count(std::size_t n) {
  t_[0] += n;
  if (t_[0] < n) ++t_[1];
}

void Blake2b::finish(std::uint8_t* out) {
  count(buf_len_);
  std::memset(buf_ + buf_len_, 0, sizeof buf_ - buf_len_);
  compress(buf_, true);
  for (std::size_t i = 0; i < digest_bytes_; ++i) {
    out[i] = static_cast<std::uint8_t>(h_[i / 8] >> (8 * (i % 8)));
  }
}

}  // namespace hicache::detail
