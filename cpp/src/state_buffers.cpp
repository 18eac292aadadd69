#include "hicache/state_buffers.hpp"

#include <stdexcept>

namespace hicache {
namespace {

std::string sizes(const std::vector<std::int64_t>& part_bytes) {
  std::string s;
  for (std::size_t i = 0; i < part_bytes.size(); ++i) {
    s += (i ? ", " : "") + std::to_string(part_bytes[i]);
  }
  return s;
}

}  // namespace

void check_state_buffers(const StateBuffers& state, const std::vector<std::int64_t>& part_bytes,
                         const Device& device, const std::string& what, const std::string& verb) {
  if (part_bytes.size() == 1) {  // the common case keeps its short message
    const DeviceBuffer* b = state.parts.size() == 1 ? &state.parts[0] : nullptr;
    if (b == nullptr || b->data == nullptr || b->bytes != static_cast<std::size_t>(part_bytes[0]) ||
        !(b->device == device)) {
      throw std::invalid_argument(
          what + " " + verb + " " + std::to_string(part_bytes[0]) + " bytes on " + device.str() +
          (b == nullptr ? " (got " + std::to_string(state.parts.size()) + " parts)"
                        : " (got " + std::to_string(b->bytes) + " bytes on " + b->device.str() +
                              (b->data == nullptr ? ", no memory" : "") + ")"));
    }
    return;
  }
  if (state.parts.size() != part_bytes.size()) {
    throw std::invalid_argument(what + " " + verb + " " + std::to_string(part_bytes.size()) +
                                " parts of [" + sizes(part_bytes) + "] bytes on " + device.str() +
                                " (got " + std::to_string(state.parts.size()) + " parts)");
  }
  for (std::size_t i = 0; i < part_bytes.size(); ++i) {
    const DeviceBuffer& b = state.parts[i];
    if (b.data == nullptr || b.bytes != static_cast<std::size_t>(part_bytes[i]) ||
        !(b.device == device)) {
      throw std::invalid_argument(what + " part " + std::to_string(i) + " " + verb + " " +
                                  std::to_string(part_bytes[i]) + " bytes on " + device.str() +
                                  " (got " + std::to_string(b.bytes) + " bytes on " +
                                  b.device.str() + (b.data == nullptr ? ", no memory" : "") +
                                  "); the parts are [" + sizes(part_bytes) + "] bytes");
    }
  }
}

}  // namespace hicache
