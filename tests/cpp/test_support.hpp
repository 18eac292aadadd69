#pragma once
// Small builders shared by the GoogleTest files.

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace hicache_test {

/// Token ids start, start+1, ..., start+n-1.
inline std::vector<std::int32_t> tokens(std::size_t n, std::int32_t start = 0) {
  std::vector<std::int32_t> t(n);
  for (std::size_t i = 0; i < n; ++i) t[i] = start + static_cast<std::int32_t>(i);
  return t;
}

/// Block ids first, first+1, ..., first+n-1.
inline std::vector<std::int64_t> ids(std::int64_t first, std::int64_t n) {
  std::vector<std::int64_t> v;
  for (std::int64_t i = 0; i < n; ++i) v.push_back(first + i);
  return v;
}

/// `prefix` followed by n in decimal ("p" + 7: "p7"). Built by appending: GCC 12 at -O2 warns
/// falsely (-Wrestrict, GCC bug 105329) on `"p" + std::to_string(i)`.
inline std::string numbered(std::string_view prefix, long long n) {
  std::string s(prefix);
  s += std::to_string(n);
  return s;
}

}  // namespace hicache_test
