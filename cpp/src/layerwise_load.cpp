#include "hicache/layerwise_load.hpp"

#include <utility>

#include "layer_queue.hpp"

namespace hicache {

LayerwiseLoad::LayerwiseLoad(LayerwiseLoad&& other) noexcept
    : tokens_(std::exchange(other.tokens_, 0)), queue_(std::move(other.queue_)) {}

LayerwiseLoad& LayerwiseLoad::operator=(LayerwiseLoad&& other) noexcept {
  if (this != &other) {
    if (queue_) queue_->abandon();
    tokens_ = std::exchange(other.tokens_, 0);
    queue_ = std::move(other.queue_);
  }
  return *this;
}

LayerwiseLoad::~LayerwiseLoad() {
  if (queue_) queue_->abandon();
}

std::size_t LayerwiseLoad::layers() const { return queue_ ? queue_->layers() : 0; }

bool LayerwiseLoad::ready(std::size_t layer) const {
  return !queue_ || queue_->fence(layer)->done();
}

void LayerwiseLoad::wait(std::size_t layer, StreamHandle stream) const {
  if (queue_) queue_->fence(layer)->enqueue_wait(stream);
}

void LayerwiseLoad::synchronize() const {
  if (queue_) queue_->fence(queue_->layers() - 1)->wait();  // one stream: the last covers all
}

}  // namespace hicache
