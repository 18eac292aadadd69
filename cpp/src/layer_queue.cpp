#include "layer_queue.hpp"

#include <stdexcept>
#include <utility>

#include "hicache/error.hpp"

namespace hicache::detail {

LayerQueue::LayerQueue(std::shared_ptr<std::mutex> mutex, Plan plan)
    : mutex_(std::move(mutex)), plan_(std::move(plan)) {
  fences_.reserve(layers());
}

std::size_t LayerQueue::layer_bytes(std::size_t layer) const {
  return plan_.moves.size() *
         plan_.layout->range_bytes(plan_.layer_starts[layer], plan_.layer_starts[layer + 1]);
}

void LayerQueue::issue_through(std::size_t layer) {
  std::size_t last = layer;
  for (std::size_t extra = 0; last + 1 < layers() && extra < plan_.ahead_bytes;) {
    extra += layer_bytes(++last);
  }
  for (std::size_t l = fences_.size(); l <= last; ++l) {
    bool copied = false;
    try {
      plan_.copier->copy_segments(Direction::kToDevice, *plan_.layout, plan_.moves,
                                  plan_.layer_starts[l], plan_.layer_starts[l + 1], plan_.stream);
      copied = true;
      fences_.push_back(plan_.copier->record(plan_.stream));
    } catch (const Error& e) {
      closed_ = true;
      // Copies enqueued without a fence may still be running: the pages stay held for good
      // rather than be reused under them (as HostPrefixCache::register_transfer does).
      unfenced_ = copied;
      failure_ =
          "layer " + std::to_string(l) + " of a layer-wise load could not be issued: " + e.what();
      throw Error(failure_);
    }
  }
}

void LayerQueue::start() { issue_through(0); }

bool LayerQueue::done() {
  if (unfenced_ || (!closed_ && fences_.size() < layers())) return false;
  return fences_.empty() || fences_.back()->done();  // one stream: the last covers the rest
}

void LayerQueue::wait() noexcept {
  closed_ = true;
  if (!fences_.empty()) fences_.back()->wait();
}

std::shared_ptr<Fence> LayerQueue::fence(std::size_t layer) {
  const std::lock_guard<std::mutex> g(*mutex_);
  if (layer >= layers()) {
    throw std::out_of_range("layer " + std::to_string(layer) + " of a load of " +
                            std::to_string(layers()) + " layers");
  }
  if (!closed_) {
    try {
      issue_through(layer);
    } catch (const Error&) {
      if (plan_.on_error) plan_.on_error(failure_);  // counted by the cache, as in try_resume
      throw;
    }
  }
  if (layer >= fences_.size()) {
    throw Error(failure_.empty() ? "layer " + std::to_string(layer) +
                                       " of a layer-wise load: the cache was destroyed first"
                                 : failure_);
  }
  return fences_[layer];
}

void LayerQueue::abandon() noexcept {
  const std::lock_guard<std::mutex> g(*mutex_);
  closed_ = true;
}

}  // namespace hicache::detail
