#pragma once
// The command-line flags of bench/research's C++ probes: `--name value` pairs, looked up by name.

#include <cstdlib>
#include <string>

namespace probe {

/// The number after `name`, or `fallback` if the flag is not given.
inline long arg(int argc, char** argv, const char* name, long fallback) {
  for (int i = 1; i + 1 < argc; ++i) {
    if (std::string(argv[i]) == name) return std::strtol(argv[i + 1], nullptr, 10);
  }
  return fallback;
}

/// The word after `name`, or `fallback` if the flag is not given.
inline std::string arg(int argc, char** argv, const char* name, const char* fallback) {
  for (int i = 1; i + 1 < argc; ++i) {
    if (std::string(argv[i]) == name) return argv[i + 1];
  }
  return fallback;
}

}  // namespace probe
