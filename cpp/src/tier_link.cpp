#include "tier_link.hpp"

#include <algorithm>
#include <exception>

#include "hicache/hash_chain.hpp"
#include "hicache/tier_record.hpp"
#include "page_threads.hpp"

namespace hicache {
namespace {

// How long a background fetch may take before the tier thread gives up on it.
constexpr auto kPrefetchDeadline = std::chrono::seconds(10);
// Rounds of a put or a get that have a buffer (each half of it): one crosses the network while
// the other is encoded or checked. Only one is ever in flight: Mooncake's client moves two
// batches at once slower than one after the other (on the 2-core CI machine, 256 MiB as two
// concurrent puts of 128 took 80 ms, as one put 64 ms and as four in turn 63; gets 63, 57, 58).
constexpr std::size_t kRing = 2;

}  // namespace

TierLink::TierLink(std::shared_ptr<Tier> tier, TierOptions options, Key space,
                   std::size_t page_bytes, std::int64_t block_tokens, Release release, Adopt adopt)
    : tier_(std::move(tier)),
      options_((options.validate(), std::move(options))),
      space_(space),
      page_bytes_(page_bytes),
      block_tokens_(block_tokens),
      value_bytes_(tier_value_bytes(block_tokens, page_bytes)),
      // Pages, not values: a value is a page and its record (a few hundred bytes), so half of
      // 128 MiB holds 64 values of 1 MiB pages, not 63 (see Rounds).
      round_pages_(std::max<std::size_t>(
          1, static_cast<std::size_t>(options_.buffer_bytes) / kRing / page_bytes_)),
      release_(std::move(release)),
      adopt_(std::move(adopt)),
      put_buffer_(buffer(kRing * round_pages_ * value_bytes_)),
      get_buffer_(buffer(kRing * round_pages_ * value_bytes_)) {
  tier_->use_buffers({put_buffer_.get(), kRing * round_pages_ * value_bytes_},
                     {get_buffer_.get(), kRing * round_pages_ * value_bytes_});
  worker_ = std::thread([this] { run(); });
}

TierLink::~TierLink() {
  {
    std::lock_guard<std::mutex> g(mu_);
    stop_ = true;
  }
  wake_.notify_all();
  worker_.join();
  // A get given up on may still write into the get buffer: wait for it before freeing.
  std::lock_guard<std::mutex> g(get_mu_);
  while (!settle(late_gets_)) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  try {
    tier_->release_buffers({put_buffer_.get(), kRing * round_pages_ * value_bytes_},
                           {get_buffer_.get(), kRing * round_pages_ * value_bytes_});
  } catch (const std::exception&) {  // a destructor must not throw; the backend is done with them
  }
}

void TierLink::note_error(const std::string& what) {
  std::lock_guard<std::mutex> g(mu_);
  ++counters_.tier_errors;
  counters_.tier_last_error = what;
}

bool TierLink::offer(std::vector<PutPage>& pages) {
  const auto n = static_cast<std::int64_t>(pages.size());
  {
    std::lock_guard<std::mutex> g(mu_);
    if (stop_ || queued_pages_ + n > options_.queue_pages) {
      counters_.tier_pages_dropped += n;
      return false;
    }
    queued_pages_ += n;
    jobs_.push_back({std::move(pages), std::nullopt});
  }
  wake_.notify_one();
  return true;
}

bool TierLink::prefetch(FetchJob job) {
  {
    std::lock_guard<std::mutex> g(mu_);
    const auto n = job.max_pages - static_cast<std::int64_t>(job.from);
    if (stop_ || queued_pages_ + n > options_.queue_pages) return false;
    queued_pages_ += n;
    jobs_.push_back({{}, std::move(job)});
  }
  wake_.notify_one();
  return true;
}

void TierLink::drain() {
  std::unique_lock<std::mutex> g(mu_);
  idle_.wait(g, [&] { return jobs_.empty() && !busy_; });
}

void TierLink::run() {
  std::unique_lock<std::mutex> g(mu_);
  for (;;) {
    wake_.wait(g, [&] { return stop_ || !jobs_.empty(); });
    if (jobs_.empty()) return;  // stopping, and everything queued was written
    Job job = std::move(jobs_.front());
    jobs_.pop_front();
    busy_ = true;
    g.unlock();
    if (job.fetch) {
      prefetch_now(*job.fetch);
    } else {
      write(job.puts);
    }
    g.lock();
    queued_pages_ -= job.fetch ? job.fetch->max_pages - static_cast<std::int64_t>(job.fetch->from)
                               : static_cast<std::int64_t>(job.puts.size());
    busy_ = false;
    if (jobs_.empty()) idle_.notify_all();
  }
}

void TierLink::write(std::vector<PutPage>& pages) {
  // Rounds through a ring of put buffers: copy record + page out of the host slots (and give
  // the slots back), put, and encode the next rounds while earlier ones cross the network.
  struct Round {
    std::int64_t batch;
    std::size_t n;
  };
  std::deque<Round> flying;
  auto land = [&](const Round& r) {
    std::int64_t ok = 0, failed = static_cast<std::int64_t>(r.n);
    try {
      if (auto results = wait(r.batch, Clock::time_point::max())) {
        failed = 0;
        for (std::int64_t x : *results) (x >= 0 ? ok : failed) += 1;
      }
    } catch (const std::exception& e) {
      note_error(std::string("tier put: ") + e.what());
      return;
    }
    std::lock_guard<std::mutex> g(mu_);
    counters_.tier_pages_written += ok;
    if (failed) {
      ++counters_.tier_errors;
      counters_.tier_last_error = "tier put: " + std::to_string(failed) + " pages refused";
    }
  };
  // Round r is encoded into its buffer while round r - 1 crosses the network (round r - 2,
  // which used the same buffer, landed before r - 1 was put), then put once r - 1 landed.
  const Rounds plan = rounds(pages.size());
  for (std::size_t begin = 0, r = 0; begin < pages.size(); begin += plan.size(r), ++r) {
    const std::size_t n = plan.size(r);
    std::byte* base = put_buffer_.get() + (r % kRing) * round_pages_ * value_bytes_;
    std::vector<std::string> names;
    std::vector<const std::byte*> values;
    std::vector<std::size_t> sizes(n, value_bytes_);
    std::vector<Entry*> entries;
    for (std::size_t j = 0; j < n; ++j) {
      const PutPage& p = pages[begin + j];
      names.push_back(tier_value_name(space_, p.key));
      values.push_back(base + j * value_bytes_);
      entries.push_back(p.entry);
    }
    detail::for_each_page(n, value_bytes_, [&](std::size_t j) {
      const PutPage& p = pages[begin + j];
      encode_tier_value(base + j * value_bytes_, space_, p.key, p.parent, p.tokens,
                        {p.page, page_bytes_});
    });
    release_(entries);
    for (; !flying.empty(); flying.pop_front()) land(flying.front());
    try {
      std::lock_guard<std::mutex> t(tier_mu_);
      flying.push_back({tier_->put(names, values, sizes), n});
    } catch (const std::exception& e) {
      note_error(std::string("tier put: ") + e.what());
    }
  }
  for (const Round& r : flying) land(r);
}

TierLink::Rounds::Rounds(std::size_t pages, std::size_t most)
    : count(std::max<std::size_t>(1, (pages + most - 1) / most)),
      base(pages / count),
      extra(pages % count) {}

TierLink::Rounds TierLink::rounds(std::size_t pages) const { return {pages, round_pages_}; }

void TierLink::prefetch_now(FetchJob& job) {
  job.keys = chain_keys(job.salt, job.prompt, block_tokens_, job.max_pages, job.key_bits);
  fetch_into(
      job.keys, job.prompt, job.salt, job.from, Clock::now() + kPrefetchDeadline,
      [&](std::size_t from, std::span<const TierPage> pages) { return adopt_(job, from, pages); });
}

void TierLink::fetch_into(std::span<const Key> keys, std::span<const std::int32_t> prompt,
                          std::string_view salt, std::size_t from, Clock::time_point deadline,
                          const Take& take) {
  Fetch f = fetch(keys, prompt, salt, from, deadline);
  for (Run run = f.next(); !run.pages.empty(); run = f.next()) {
    if (take(run.from, run.pages) < run.pages.size() || !run.complete) break;
  }
}

TierLink::Fetch TierLink::fetch(std::span<const Key> keys, std::span<const std::int32_t> prompt,
                                std::string_view salt, std::size_t from,
                                Clock::time_point deadline) {
  return Fetch(*this, keys, prompt, salt, from, deadline);
}

TierLink::Fetch::Fetch(TierLink& link, std::span<const Key> keys,
                       std::span<const std::int32_t> prompt, std::string_view salt,
                       std::size_t from, Clock::time_point deadline)
    : link_(&link),
      hold_(link.get_mu_),
      keys_(keys),
      prompt_(prompt),
      root_(tier_salt_digest(salt)),
      next_(from),
      plan_(link.rounds(keys.size() > from ? keys.size() - from : 0)),
      deadline_(deadline) {
  if (!link.settle(link.late_gets_)) {  // earlier gets given up on still write the buffer
    over_ = true;
    std::lock_guard<std::mutex> g(link.mu_);
    ++link.counters_.tier_fetches_late;
  }
}

TierLink::Fetch::~Fetch() {
  if (!hold_.owns_lock()) return;  // moved from
  for (const Round& r : rounds_) link_->late_gets_.push_back(r.batch);
}

void TierLink::Fetch::submit() {
  // One round in flight (kRing). Rounds alternate buffers: the one submitted while next()
  // hands out a run never writes that run's buffer (the caller reads it until it asks for the
  // next run); it reuses the buffer of the run before, which the caller is done with.
  if (!over_ && rounds_.empty() && next_ < keys_.size()) {
    const std::size_t n = std::min(plan_.size(ring_), keys_.size() - next_);
    const std::size_t ring = ring_++ % kRing;
    std::byte* base = link_->get_buffer_.get() + ring * link_->round_pages_ * link_->value_bytes_;
    std::vector<std::string> names;
    std::vector<std::byte*> dests;
    for (std::size_t j = 0; j < n; ++j) {
      names.push_back(tier_value_name(link_->space_, keys_[next_ + j]));
      dests.push_back(base + j * link_->value_bytes_);
    }
    try {
      std::lock_guard<std::mutex> t(link_->tier_mu_);
      rounds_.push_back({next_, n, ring, link_->tier_->get(names, dests, link_->value_bytes_)});
    } catch (const std::exception& e) {
      link_->note_error(std::string("tier get: ") + e.what());
      over_ = true;
      return;
    }
    next_ += n;
  }
}

TierLink::Run TierLink::Fetch::next() {
  Run out;
  submit();
  if (rounds_.empty()) return out;
  const Round r = rounds_.front();
  rounds_.pop_front();
  out.from = r.first;
  std::optional<std::vector<std::int64_t>> results;
  try {
    results = link_->wait(r.batch, deadline_);
  } catch (const std::exception& e) {
    link_->note_error(std::string("tier get: ") + e.what());
    over_ = true;
    return out;
  }
  if (!results) {
    link_->late_gets_.push_back(r.batch);
    over_ = true;
    std::lock_guard<std::mutex> g(link_->mu_);
    ++link_->counters_.tier_fetches_late;
    return out;
  }
  // The next round crosses the network while this one is checked and copied out.
  submit();
  const auto B = static_cast<std::size_t>(link_->block_tokens_);
  const std::byte* base =
      link_->get_buffer_.get() + r.ring * link_->round_pages_ * link_->value_bytes_;
  std::string why;
  std::int64_t missing = 0, rejected = 0, failed = 0;
  if (results->size() != r.n) {
    failed = 1;
  } else {
    for (std::size_t j = 0; j < r.n; ++j) {
      const std::size_t i = r.first + j;
      const std::int64_t x = (*results)[j];
      if (x < 0) {
        (x == Tier::kMissing ? missing : failed) += 1;
        break;
      }
      const std::span<const std::byte> value(base + j * link_->value_bytes_,
                                             static_cast<std::size_t>(x));
      const TierPage page =
          check_tier_record(value, link_->space_, keys_[i], i == 0 ? root_ : keys_[i - 1],
                            prompt_.subspan(i * B, B), link_->page_bytes_, why);
      if (page.bytes.empty()) {
        rejected += 1;
        break;
      }
      out.pages.push_back(page);
    }
  }
  out.complete = out.pages.size() == r.n;
  if (!out.complete) over_ = true;  // later rounds are of no use past a hole
  std::lock_guard<std::mutex> g(link_->mu_);
  link_->counters_.tier_pages_missing += missing;
  link_->counters_.tier_pages_rejected += rejected;
  if (rejected) link_->counters_.tier_last_error = "tier value rejected: " + why;
  if (failed) {
    ++link_->counters_.tier_errors;
    link_->counters_.tier_last_error = "tier get failed";
  }
  return out;
}

std::optional<std::vector<std::int64_t>> TierLink::wait(std::int64_t batch,
                                                        Clock::time_point deadline) {
  auto pause = std::chrono::microseconds(5);
  bool waited = false;  // the last try ended in a wait() that said it blocked
  for (;;) {
    {
      std::lock_guard<std::mutex> t(tier_mu_);
      if (auto r = tier_->poll(batch)) return r;
    }
    const auto now = Clock::now();
    if (now >= deadline) return std::nullopt;
    // Without tier_mu_: another thread may put or fetch meanwhile. At most a second at a time,
    // so that a backend that misses a completion costs a poll, not a hang. After a wait that
    // ended with the batch still running, a pause: a backend whose wait() returns at once while
    // saying it blocked is then polled as one that cannot block, instead of spinning.
    if (!waited) {
      const auto left = std::min<Clock::duration>(deadline - now, std::chrono::seconds(1));
      waited = tier_->wait(batch, std::chrono::ceil<std::chrono::microseconds>(left));
      if (waited) continue;
    }
    waited = false;
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::microseconds(100));
  }
}

bool TierLink::settle(std::vector<std::int64_t>& batches) {
  std::lock_guard<std::mutex> t(tier_mu_);
  std::erase_if(batches, [&](std::int64_t b) {
    try {
      return tier_->poll(b).has_value();
    } catch (const std::exception&) {
      return true;  // the backend no longer knows it: nothing will write for it any more
    }
  });
  return batches.empty();
}

void TierLink::note_rejected(const std::string& why) {
  std::lock_guard<std::mutex> g(mu_);
  ++counters_.tier_pages_rejected;
  counters_.tier_last_error = "tier value rejected: " + why;
}

void TierLink::add_stats(CacheStats& s) const {
  std::lock_guard<std::mutex> g(mu_);
  s.tier_pages_written = counters_.tier_pages_written;
  s.tier_pages_dropped = counters_.tier_pages_dropped;
  s.tier_pages_missing = counters_.tier_pages_missing;
  s.tier_pages_rejected = counters_.tier_pages_rejected;
  s.tier_fetches_late = counters_.tier_fetches_late;
  s.tier_errors = counters_.tier_errors;
  s.tier_last_error = counters_.tier_last_error;
}

}  // namespace hicache
