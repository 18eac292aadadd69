// The CPU copier's streaming copy: every byte of every size and alignment lands where memcpy
// would put it, nothing beside the destination is touched, on both of its forms.
#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <vector>

#include "stream_copy.hpp"

namespace {

using Copy = void (*)(std::byte*, const std::byte*, std::size_t);

// Copies n bytes between buffers offset from a 64-byte boundary by src_off and dst_off, and
// checks the destination against the source and the bytes around it against their fill.
void check(Copy copy, std::size_t n, std::size_t src_off, std::size_t dst_off) {
  constexpr std::size_t kPad = 256;
  std::vector<std::byte> src(n + kPad + 64), dst(n + 2 * kPad + 64, std::byte{0xA5});
  for (std::size_t i = 0; i < src.size(); ++i) {
    src[i] = static_cast<std::byte>((i * 131 + n) % 251);
  }
  auto aligned = [](std::vector<std::byte>& v) {
    const auto at = reinterpret_cast<std::uintptr_t>(v.data());
    return v.data() + (64 - at % 64) % 64;
  };
  const std::byte* from = aligned(src) + src_off;
  std::byte* to = aligned(dst) + kPad / 2 + dst_off;
  copy(to, from, n);
  for (std::size_t i = 0; i < n; ++i) {
    ASSERT_EQ(to[i], from[i]) << "byte " << i << " of " << n << ", offsets " << src_off << "/"
                              << dst_off;
  }
  for (std::byte* p = dst.data(); p < to; ++p) ASSERT_EQ(*p, std::byte{0xA5}) << "before";
  for (std::byte* p = to + n; p < dst.data() + dst.size(); ++p) {
    ASSERT_EQ(*p, std::byte{0xA5}) << "after " << n << " bytes";
  }
}

void every_shape(Copy copy) {
  // Around a line, a 4 KiB stretch and the four at a time the copy interleaves.
  const std::size_t sizes[] = {
      0,    1,    15,    63,    64,    65,    127,    4095,
      4096, 4097, 16383, 16384, 16385, 49229, 1048579};  // 3 x 16 KiB + 77, 1 MiB + 3
  const std::size_t offsets[] = {0, 1, 8, 33, 63};
  for (std::size_t n : sizes) {
    for (std::size_t src_off : offsets) {
      for (std::size_t dst_off : offsets) check(copy, n, src_off, dst_off);
    }
  }
}

TEST(StreamCopy, EveryByteLandsAndNothingBesideIsTouched) {
  every_shape(hicache::detail::copy_streaming);
}

TEST(StreamCopy, TheSse2FormToo) { every_shape(hicache::detail::copy_streaming_sse2); }

}  // namespace
