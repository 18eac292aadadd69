#include "page_checksum.hpp"

#include <array>
#include <cstring>

#include "page_checksum_def.hpp"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define HICACHE_CHECKSUM_AVX2 1
#endif

namespace hicache::detail {
namespace {

namespace def = checksum_def;
using def::kBlock;
using def::kLanes;
using def::kScramble;
using def::kStripe;
using def::kStripes;
using u64 = def::u64;

// Lane i of stripe s mixes its word with kSecret[s + i]; the scramble uses kSecret[16 + i].
constexpr std::array<u64, kStripes + kLanes> kSecret = [] {
  std::array<u64, kStripes + kLanes> s{};
  for (std::size_t i = 0; i < s.size(); ++i) s[i] = def::secret(static_cast<int>(i));
  return s;
}();
static_assert(kBlock == ChecksumCopy::kBlock);

// One stripe, one lane at a time: the definition the vector form must match.
void stripe(u64* acc, const std::byte* p, int s, std::byte* out) {
  u64 w[kLanes];
  std::memcpy(w, p, kStripe);
  if (out != nullptr) std::memcpy(out, w, kStripe);
  for (int i = 0; i < kLanes; ++i) {
    acc[i] = def::accumulate(acc[i], w[i], kSecret[static_cast<std::size_t>(s + i)]);
  }
}

void scramble(u64* acc) {
  for (int i = 0; i < kLanes; ++i) {
    acc[i] = def::scramble(acc[i], kSecret[static_cast<std::size_t>(kStripes + i)]);
  }
}

// The stripes after the last whole block (no scramble after them), the bytes after the last
// stripe, and the lanes folded into one value.
u64 finish(u64* acc, const std::byte* p, std::size_t n, std::byte* out, std::size_t total) {
  for (int s = 0; n >= kStripe; ++s, n -= kStripe, p += kStripe) {
    stripe(acc, p, s, out);
    if (out != nullptr) out += kStripe;
  }
  u64 h = def::fold(acc, total);
  if (out != nullptr) std::memcpy(out, p, n);
  for (; n > 0; --n, ++p) h = def::tail_byte(h, static_cast<std::uint8_t>(*p));
  return def::finish(h);
}

#ifdef HICACHE_CHECKSUM_AVX2
#define HICACHE_AVX2 __attribute__((target("avx2")))

// Four lanes of one stripe (`d`, mixed with the secret `k`) added to `a`.
HICACHE_AVX2 inline __m256i accumulate(__m256i a, __m256i d, __m256i k) {
  const __m256i x = _mm256_xor_si256(d, k);
  return _mm256_add_epi64(a, _mm256_add_epi64(d, _mm256_mul_epu32(x, _mm256_srli_epi64(x, 32))));
}

HICACHE_AVX2 inline __m256i scrambled(__m256i a, __m256i k) {
  const __m256i m = _mm256_set1_epi64x(static_cast<long long>(kScramble));
  a = _mm256_xor_si256(_mm256_xor_si256(a, _mm256_srli_epi64(a, 47)), k);
  // a * kScramble mod 2^64 from 32-bit products: lo * m + (hi * m) << 32.
  return _mm256_add_epi64(_mm256_mul_epu32(a, m),
                          _mm256_slli_epi64(_mm256_mul_epu32(_mm256_srli_epi64(a, 32), m), 32));
}

HICACHE_AVX2 void blocks_avx2(u64* acc, const std::byte* p, std::size_t blocks, std::byte* out) {
  using V = __m256i_u;
  __m256i a0 = _mm256_loadu_si256(reinterpret_cast<const V*>(acc));
  __m256i a1 = _mm256_loadu_si256(reinterpret_cast<const V*>(acc + 4));
  const __m256i s0 = _mm256_loadu_si256(reinterpret_cast<const V*>(kSecret.data() + kStripes));
  const __m256i s1 = _mm256_loadu_si256(reinterpret_cast<const V*>(kSecret.data() + kStripes + 4));
  // Streaming stores where the destination allows them: the copy's destination (a host slot the
  // GPU reads, a value the network reads) is not read by this core again, and a plain store
  // first reads each line it writes. 64 MiB copied and summed on one core of this project's
  // 2-core machine: 2.5 ms instead of 3.1. A destination off a 32-byte boundary (numpy's large
  // arrays are 16 bytes past one: malloc's mmap plus its header) is streamed too, in 64-byte
  // lines of its own: from its first line boundary on, each stripe's copy stores the 64 source
  // bytes that land in one destination line (loaded again, from the cache, `shift` bytes on),
  // and the bytes before the first boundary and after the last go by memcpy. With plain stores
  // there, 256 MiB of 1 MiB pages were copied and summed on two threads at 10.6 GB/s against
  // 15.4 into aligned memory.
  const std::size_t n = blocks * kBlock;
  const auto at = reinterpret_cast<std::uintptr_t>(out);
  const bool stream = out != nullptr && at % 32 == 0;
  // Never 0 for such a destination: at % 64 is not 0 where at % 32 is not (n is 0 without blocks).
  const std::size_t shift =
      out != nullptr && !stream && n >= kStripe ? (kStripe - at % kStripe) : 0;
  const std::byte* const from = p;
  std::byte* const to = out;
  for (std::size_t b = 0; b < blocks; ++b) {
    for (int s = 0; s < kStripes; ++s, p += kStripe) {
      // The next block's line asked for now. With the hardware's prefetch alone, 256 MiB of
      // 1 MiB pages on two threads of the 2-core machine were copied and summed at 13.4-16.4
      // GB/s and summed alone at 15.7-18.0; with this, 16.9-18.4 and 20.4-23.4 (256 and 4096
      // bytes ahead measured alike).
      _mm_prefetch(reinterpret_cast<const char*>(p + kBlock), _MM_HINT_T0);
      const __m256i d0 = _mm256_loadu_si256(reinterpret_cast<const V*>(p));
      const __m256i d1 = _mm256_loadu_si256(reinterpret_cast<const V*>(p + 32));
      if (stream) {
        _mm256_stream_si256(reinterpret_cast<__m256i*>(out), d0);
        _mm256_stream_si256(reinterpret_cast<__m256i*>(out + 32), d1);
        out += kStripe;
      } else if (shift > 0) {
        // The destination line that starts `shift` bytes into this stripe, where it ends
        // inside the call's bytes (all but the last stripe's).
        if (p + shift + kStripe <= from + n) {
          const __m256i e0 = _mm256_loadu_si256(reinterpret_cast<const V*>(p + shift));
          const __m256i e1 = _mm256_loadu_si256(reinterpret_cast<const V*>(p + shift + 32));
          _mm256_stream_si256(reinterpret_cast<__m256i*>(out + shift), e0);
          _mm256_stream_si256(reinterpret_cast<__m256i*>(out + shift + 32), e1);
        }
        out += kStripe;
      }  // a destination off 32 bytes always has a shift: no plain stores are left
      const auto* k = reinterpret_cast<const V*>(kSecret.data() + s);
      a0 = accumulate(a0, d0, _mm256_loadu_si256(k));
      a1 = accumulate(a1, d1, _mm256_loadu_si256(k + 1));
    }
    a0 = scrambled(a0, s0);
    a1 = scrambled(a1, s1);
  }
  if (shift > 0) {  // before the first line boundary, and after the last streamed line
    std::memcpy(to, from, shift);
    std::memcpy(to + n - (kStripe - shift), from + n - (kStripe - shift), kStripe - shift);
  }
  if (stream || shift > 0) _mm_sfence();  // the streamed lines are visible before anyone is told
  _mm256_storeu_si256(reinterpret_cast<V*>(acc), a0);
  _mm256_storeu_si256(reinterpret_cast<V*>(acc + 4), a1);
}

bool has_avx2() {
  static const bool yes = __builtin_cpu_supports("avx2");
  return yes;
}
#endif

// Whole blocks, stripe by stripe with the scalar definition.
void blocks_portable(u64* acc, const std::byte* p, std::size_t blocks, std::byte* out) {
  for (std::size_t b = 0; b < blocks; ++b) {
    for (int s = 0; s < kStripes; ++s, p += kStripe) {
      stripe(acc, p, s, out);
      if (out != nullptr) out += kStripe;
    }
    scramble(acc);
  }
}

void blocks(u64* acc, const std::byte* p, std::size_t n, std::byte* out, bool vector) {
#ifdef HICACHE_CHECKSUM_AVX2
  if (vector) {
    blocks_avx2(acc, p, n, out);
  } else {
    blocks_portable(acc, p, n, out);
  }
#else
  (void)vector;
  blocks_portable(acc, p, n, out);
#endif
}

bool use_vector() {
#ifdef HICACHE_CHECKSUM_AVX2
  return has_avx2();
#else
  return false;
#endif
}

void init(u64* acc) {
  for (int i = 0; i < kLanes; ++i) acc[i] = kSecret[static_cast<std::size_t>(i)];
}

u64 checksum(std::span<const std::byte> bytes, std::byte* out, bool vector) {
  u64 acc[kLanes];
  init(acc);
  const std::size_t n = bytes.size() / kBlock;
  blocks(acc, bytes.data(), n, out, vector);
  const std::size_t done = n * kBlock;
  return finish(acc, bytes.data() + done, bytes.size() - done, out ? out + done : nullptr,
                bytes.size());
}

}  // namespace

std::uint64_t checksum_copy_portable(std::span<const std::byte> bytes, std::byte* out) {
  return checksum(bytes, out, false);
}

std::uint64_t checksum_copy(std::span<const std::byte> bytes, std::byte* out) {
  return checksum(bytes, out, use_vector());
}

ChecksumCopy::ChecksumCopy() { init(acc_); }

bool ChecksumCopy::add(std::span<const std::byte> bytes, std::byte* out) {
  if (total_ % kBlock != 0) return false;  // a piece after one that was not whole blocks
  const std::size_t n = bytes.size() / kBlock;
  blocks(acc_, bytes.data(), n, out, use_vector());
  const std::size_t done = n * kBlock;
  total_ += bytes.size();
  if (done < bytes.size()) {  // the page's last piece: its tail is summed by value()
    tail_ = bytes.subspan(done);
    if (out != nullptr) std::memcpy(out + done, tail_.data(), tail_.size());
  }
  return true;
}

std::uint64_t ChecksumCopy::value() {
  return finish(acc_, tail_.data(), tail_.size(), nullptr, total_);
}

}  // namespace hicache::detail
