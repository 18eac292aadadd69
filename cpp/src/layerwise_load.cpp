#include "hicache/layerwise_load.hpp"

#include <stdexcept>
#include <string>

namespace hicache {

void LayerwiseLoad::check(std::size_t layer) const {
  if (!fences_.empty() && layer >= fences_.size()) {
    throw std::out_of_range("layer " + std::to_string(layer) + " of a load of " +
                            std::to_string(fences_.size()) + " layers");
  }
}

bool LayerwiseLoad::ready(std::size_t layer) const {
  check(layer);
  return fences_.empty() || fences_[layer]->done();
}

void LayerwiseLoad::wait(std::size_t layer, StreamHandle stream) const {
  check(layer);
  if (!fences_.empty()) fences_[layer]->enqueue_wait(stream);
}

void LayerwiseLoad::synchronize() const {
  if (!fences_.empty()) fences_.back()->wait();  // one stream: the last fence covers them all
}

}  // namespace hicache
