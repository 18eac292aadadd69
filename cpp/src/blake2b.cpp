#include "blake2b.hpp"

#include <bit>
#include <cstring>
#include <stdexcept>

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
  std::uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

// Four messages' compressions side by side: lane l of every vector belongs to message l. GCC's
// and clang's vector extensions map a vector of four 64-bit words onto one AVX2 register, or
// onto two SSE2 or NEON registers elsewhere (still four independent chains for the core to
// overlap).
using Lanes = std::uint64_t __attribute__((vector_size(32)));

// The twelve rounds over the working vector v and message m, for one message (W = uint64_t) or
// four side by side (W = Lanes: the same shifts act lane by lane). Unrolled, every message word's
// index is a constant: ~25 % faster a block than the loop.
// d = (d ^ a) rotated right by n. By reference: a vector passed by value would change the ABI
// between builds with and without AVX (-Wpsabi).
template <class W>
[[gnu::always_inline]] inline void xor_rotr(W& d, const W& a, int n) {
  const W x = d ^ a;
  d = (x >> n) | (x << (64 - n));
}

template <class W>
[[gnu::always_inline]] inline void mix(W* v, int a, int b, int c, int d, const W& x, const W& y) {
  v[a] = v[a] + v[b] + x;
  xor_rotr(v[d], v[a], 32);
  v[c] = v[c] + v[d];
  xor_rotr(v[b], v[c], 24);
  v[a] = v[a] + v[b] + y;
  xor_rotr(v[d], v[a], 16);
  v[c] = v[c] + v[d];
  xor_rotr(v[b], v[c], 63);
}

template <class W>
[[gnu::always_inline]] inline void rounds(W* v, const W* m) {
#pragma GCC unroll 12
  for (const auto& s : kSigma) {
    mix(v, 0, 4, 8, 12, m[s[0]], m[s[1]]);
    mix(v, 1, 5, 9, 13, m[s[2]], m[s[3]]);
    mix(v, 2, 6, 10, 14, m[s[4]], m[s[5]]);
    mix(v, 3, 7, 11, 15, m[s[6]], m[s[7]]);
    mix(v, 0, 5, 10, 15, m[s[8]], m[s[9]]);
    mix(v, 1, 6, 11, 12, m[s[10]], m[s[11]]);
    mix(v, 2, 7, 8, 13, m[s[12]], m[s[13]]);
    mix(v, 3, 4, 9, 14, m[s[14]], m[s[15]]);
  }
}

// One block of each message (little-endian hosts only: the words are loaded as they lie), with
// the byte count t after it (the same for all four) and not the last block.
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
  rounds(v, m);
  for (int i = 0; i < 8; ++i) {
    Lanes hi;
    std::memcpy(&hi, h[i], sizeof hi);
    hi ^= v[i] ^ v[i + 8];
    std::memcpy(h[i], &hi, sizeof hi);
  }
}

// The same code built twice, for AVX2 and for the baseline, chosen at run time (not by an ifunc
// resolver: ThreadSanitizer builds crash in one, as it runs before the sanitizer is set up).
#if defined(__x86_64__)
[[gnu::target("avx2")]] void compress4_avx2(std::uint64_t (&h)[8][4],
                                            const std::uint8_t* const block[4], std::uint64_t t0,
                                            std::uint64_t t1) {
  compress4_body(h, block, t0, t1);
}
#endif

void compress4_baseline(std::uint64_t (&h)[8][4], const std::uint8_t* const block[4],
                        std::uint64_t t0, std::uint64_t t1) {
  compress4_body(h, block, t0, t1);
}

void compress4(std::uint64_t (&h)[8][4], const std::uint8_t* const block[4], std::uint64_t t0,
               std::uint64_t t1) {
#if defined(__x86_64__)
  static const bool avx2 = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") != 0;
  }();
  if (avx2) return compress4_avx2(h, block, t0, t1);
#endif
  compress4_baseline(h, block, t0, t1);
}

}  // namespace

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
