#pragma once
// A hybrid model's state at one position, as the engine holds it: one buffer, or several parts
// (per layer a convolution and an SSM state, a sliding window's K and V; each in its own dtype).
// The cache keeps a state's parts back to back in one host slot, in order, so an engine never
// packs them into one staging tensor by hand.

#include <cstdint>
#include <initializer_list>
#include <string>
#include <utility>
#include <vector>

#include "hicache/device.hpp"

namespace hicache {

struct StateBuffers {
  std::vector<DeviceBuffer> parts;

  StateBuffers() = default;
  // Implicit on purpose: a model with one state part passes its one buffer as before.
  StateBuffers(DeviceBuffer one) : parts{one} {}  // NOLINT(google-explicit-constructor)
  StateBuffers(std::vector<DeviceBuffer> many) : parts(std::move(many)) {}  // NOLINT
  StateBuffers(std::initializer_list<DeviceBuffer> many) : parts(many) {}
};

/// Checks that `state` has one part per entry of `part_bytes`, each of exactly that many bytes
/// on `device` with memory behind it. @throws std::invalid_argument: "<what> <verb> N bytes on
/// <device> (got ...)", naming the part when there are several.
void check_state_buffers(const StateBuffers& state, const std::vector<std::int64_t>& part_bytes,
                         const Device& device, const std::string& what,
                         const std::string& verb = "must be");

}  // namespace hicache
