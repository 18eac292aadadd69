#include "tier_link.hpp"

#include <algorithm>
#include <deque>
#include <exception>
#include <iterator>
#include <map>

#include "hicache/hash_chain.hpp"
#include "hicache/tier_record.hpp"
#include "page_threads.hpp"
#include "tier_wait.hpp"

namespace hicache {
namespace {

// How long a background fetch may take before the tier thread gives up on it.
constexpr auto kPrefetchDeadline = std::chrono::seconds(10);
// Rounds that TierOptions::buffer_bytes holds: one crosses the network while the other's records
// are written (puts) or its values checked (gets). Puts keep one in flight: Mooncake's client
// moves two batches at once slower than one after the other (on the 2-core CI machine, 256 MiB as
// two concurrent puts of 128 took 80 ms, as one put 64 ms and as four in turn 63; gets 63, 57,
// 58). Gets keep Tier::gets_in_flight() behind the one being checked (one for Mooncake).
constexpr std::size_t kRing = 2;

std::string one_line(std::string_view what) {
  // A Python backend's exception arrives with its traceback ("...\n\nAt:\n  file(line)..."):
  // stats keep its first line, and not much of it.
  std::string line(what.substr(0, what.find('\n')));
  if (line.size() > 300) line = line.substr(0, 297) + "...";
  return line;
}

}  // namespace

namespace {

class TierMemory final : public HostAllocator {
 public:
  TierMemory(std::shared_ptr<HostAllocator> inner, std::shared_ptr<TierGate> gate)
      : inner_(std::move(inner)), gate_(std::move(gate)) {}
  void* allocate(std::size_t bytes) override {
    void* p = inner_->allocate(bytes);
    std::lock_guard<std::mutex> g(gate_->mu);
    try {
      gate_->tier->use_memory({static_cast<std::byte*>(p), bytes});
    } catch (const std::exception& e) {
      // Host memory all the same: the cache works, and puts from this chunk fail, counted.
      std::lock_guard<std::mutex> errors(gate_->errors_mu);
      ++gate_->memory_errors;
      gate_->memory_error = std::string("tier use_memory: ") + e.what();
    }
    return p;
  }
  void deallocate(void* p, std::size_t bytes) noexcept override {
    {
      std::lock_guard<std::mutex> g(gate_->mu);
      try {
        gate_->tier->release_memory({static_cast<std::byte*>(p), bytes});
      } catch (const std::exception&) {  // the memory goes back either way
      }
    }
    inner_->deallocate(p, bytes);
  }
  const char* name() const override { return inner_->name(); }
  bool allocation_is_slow() const override { return inner_->allocation_is_slow(); }
  bool room_for(std::size_t bytes) const override { return inner_->room_for(bytes); }
  std::string memory_report() const override { return inner_->memory_report(); }

 private:
  std::shared_ptr<HostAllocator> inner_;
  std::shared_ptr<TierGate> gate_;
};

}  // namespace

std::shared_ptr<TierGate> TierGate::of(const std::shared_ptr<Tier>& tier) {
  static std::mutex mu;
  static std::map<const Tier*, std::weak_ptr<TierGate>> gates;  // a gate keeps its tier alive
  std::lock_guard<std::mutex> g(mu);
  std::erase_if(gates, [](const auto& kv) { return kv.second.expired(); });
  std::weak_ptr<TierGate>& known = gates[tier.get()];
  if (auto gate = known.lock()) return gate;
  auto gate = std::make_shared<TierGate>(tier);
  known = gate;
  return gate;
}

std::shared_ptr<HostAllocator> tier_memory(std::shared_ptr<HostAllocator> inner,
                                           std::shared_ptr<TierGate> gate) {
  return std::make_shared<TierMemory>(std::move(inner), std::move(gate));
}

TierLink::TierLink(std::shared_ptr<TierGate> gate, TierOptions options, Key space,
                   std::size_t page_bytes, std::int64_t block_tokens, bool check_on_load, Host host)
    : gate_(std::move(gate)),
      tier_(gate_->tier.get()),
      tier_mu_(gate_->mu),
      options_((options.validate(), std::move(options))),
      space_(space),
      page_bytes_(page_bytes),
      block_tokens_(block_tokens),
      value_bytes_(tier_value_bytes(block_tokens, page_bytes)),
      // Pages, not values: a value is a page and its record (a few hundred bytes), so half of
      // 128 MiB holds 64 values of 1 MiB pages, not 63 (see plan_rounds).
      round_pages_(std::max<std::size_t>(
          1, static_cast<std::size_t>(options_.buffer_bytes) / kRing / page_bytes_)),
      check_on_load_(check_on_load),
      host_(std::move(host)) {
  worker_ = std::thread([this] { run(); });
}

TierLink::~TierLink() {
  {
    std::lock_guard<std::mutex> g(mu_);
    stop_ = true;
  }
  wake_.notify_all();
  worker_.join();
  // A get given up on may still write into its slots: wait for it before they are freed.
  std::lock_guard<std::mutex> g(get_mu_);
  while (!settle()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
}

void TierLink::note_error(const std::string& what) {
  std::lock_guard<std::mutex> g(mu_);
  ++counters_.tier_errors;
  counters_.tier_last_error = one_line(what);
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
    counters_.tier_pages_queued += n;
    jobs_.push_back({std::move(pages), std::nullopt});
  }
  wake_.notify_one();
  return true;
}

void TierLink::hold_offers(bool hold) {
  {
    std::lock_guard<std::mutex> g(mu_);
    holds_ += hold ? 1 : -1;
  }
  if (!hold) wake_.notify_one();
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

bool TierLink::drain(Clock::time_point deadline) {
  std::unique_lock<std::mutex> g(mu_);
  return idle_.wait_until(g, deadline, [&] { return jobs_.empty() && !busy_; });
}

void TierLink::run() {
  std::unique_lock<std::mutex> g(mu_);
  for (;;) {
    wake_.wait(g, [&] { return stop_ || (!jobs_.empty() && holds_ == 0); });
    if (jobs_.empty()) return;  // stopping, and everything queued was written
    Job job = std::move(jobs_.front());
    jobs_.pop_front();
    // Puts queued back to back (a store's installments, the stores a poll retired: offered
    // under hold_offers) go as one write: a batch a round, not a batch each, one after another.
    // A 64-page store offered in three installments went as three puts in turn: 0.78-0.84 of
    // the raw client's one put of the same pages on the 2-core machine.
    while (!job.fetch && !jobs_.empty() && !jobs_.front().fetch) {
      auto& more = jobs_.front().puts;
      job.puts.insert(job.puts.end(), std::make_move_iterator(more.begin()),
                      std::make_move_iterator(more.end()));
      jobs_.pop_front();
    }
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
  // Rounds straight from the host slots: each page's record is written after it (its checksum
  // taken first where the store's copy did not sum it), the round is put, and the next round's
  // records are written while it crosses the network. Entries stay pinned until their round
  // landed: the backend reads the slots until then.
  struct Round {
    std::int64_t batch;
    std::vector<Entry*> entries;
  };
  std::deque<Round> flying;
  auto land = [&](Round& r) {
    const auto n = static_cast<std::int64_t>(r.entries.size());
    std::int64_t ok = 0;
    bool threw = false;
    try {
      if (auto results = wait(r.batch, Clock::time_point::max())) {
        for (std::int64_t x : *results) ok += x >= 0 ? 1 : 0;
      }
    } catch (const std::exception& e) {
      note_error(std::string("tier put: ") + e.what());
      threw = true;
    }
    host_.release(r.entries);
    std::lock_guard<std::mutex> g(mu_);
    // Every page queued ends written or failed (or dropped, before it was queued).
    counters_.tier_pages_written += ok;
    counters_.tier_pages_failed += n - ok;
    counters_.tier_pages_queued -= n;
    if (ok < n && !threw) {
      ++counters_.tier_errors;
      counters_.tier_last_error = "tier put: " + std::to_string(n - ok) + " pages refused";
    }
  };
  // Rounds of the whole buffer, the first one whole too, whether the store summed the pages (the
  // CPU copier's) or this thread sums them as it goes (a GPU cache's): one round is summed while
  // the one before it crosses. Each batch costs the client a fixed time of its own (a one-page
  // get of 1 MiB takes 0.7-1.0 ms on an H200 host, 64 of them 10 ms), which a small first round
  // paid for one more batch: a GPU cache's put of 64 x 1 MiB in rounds of 8 + 56 spent 15.4 ms
  // in the client's calls, against 11.0 ms as one round summed on 16 threads first (1.1 ms); the
  // put of 64 x 1 MiB, 256 x 1 MiB and 32 x 8 MiB went from 0.73 / 0.90 / 0.72 of the raw
  // client's to 0.93 / 0.92 / 0.95 (docs/performance.md). 256 pages of 1 MiB in rounds of 64 were
  // put at 0.83-0.89 of the raw client's one put on the 2-core machine.
  const std::vector<std::size_t> plan =
      plan_rounds(pages.size(), kRing * round_pages_, Edge::kNone);
  for (std::size_t begin = 0, r = 0; r < plan.size(); begin += plan[r], ++r) {
    const std::size_t n = plan[r];
    std::vector<std::string> names;
    std::vector<const std::byte*> values;
    std::vector<std::size_t> sizes(n, value_bytes_);
    Round round{-1, {}};
    // Records only where every page came summed (the CPU copier's stores, the device sums):
    // too little work to wake the page threads for, as for a get's records.
    bool summed = true;
    for (std::size_t j = 0; j < n; ++j) {
      const PutPage& p = pages[begin + j];
      names.push_back(tier_value_name(space_, p.key));
      values.push_back(p.slot);
      round.entries.push_back(p.entry);
      summed = summed && p.checksum.has_value();
    }
    detail::for_each_page(
        n, summed ? 0 : page_bytes_,
        [&](std::size_t j) {
          const PutPage& p = pages[begin + j];
          const std::uint64_t sum = p.checksum ? *p.checksum : page_checksum({p.slot, page_bytes_});
          write_tier_record(p.slot + page_bytes_, space_, p.key, p.parent, p.tokens, page_bytes_,
                            sum);
        },
        detail::kTierBytesPerThread, detail::kTierPageThreads);
    for (; !flying.empty(); flying.pop_front()) land(flying.front());
    try {
      std::lock_guard<std::mutex> t(tier_mu_);
      round.batch = tier_->put(names, values, sizes);
    } catch (const std::exception& e) {
      note_error(std::string("tier put: ") + e.what());
      host_.release(round.entries);
      std::lock_guard<std::mutex> g(mu_);
      counters_.tier_pages_failed += static_cast<std::int64_t>(n);
      counters_.tier_pages_queued -= static_cast<std::int64_t>(n);
      continue;
    }
    flying.push_back(std::move(round));
  }
  for (Round& r : flying) land(r);
}

std::vector<std::size_t> TierLink::plan_rounds(std::size_t pages, std::size_t most, Edge edge) {
  if (pages == 0) return {};
  // A round of at least kEdgeShare pages only: below that the batch it adds costs more than the
  // pass over a page or two saves.
  const std::size_t full = std::min(pages, most);
  const std::size_t lead = edge == Edge::kNone || full < kEdgeShare ? 0 : full / kEdgeShare;
  const std::size_t body = pages - lead;
  const std::size_t count = std::max<std::size_t>(1, (body + most - 1) / most);
  std::vector<std::size_t> sizes;
  for (std::size_t r = 0; r < count; ++r)
    sizes.push_back(body / count + (r < body % count ? 1 : 0));
  if (edge == Edge::kLast && lead > 0) sizes.push_back(lead);
  return sizes;
}

void TierLink::prefetch_now(FetchJob& job) {
  // The keys the lookup had (its cached pages'), then the rest.
  extend_chain_keys(job.keys, job.salt, job.prompt, block_tokens_, job.max_pages, job.key_bits);
  fetch_into({job.keys, job.prompt, job.salt}, job.from, Clock::now() + kPrefetchDeadline);
}

void TierLink::fetch_into(const FetchSpec& spec, std::size_t from, Clock::time_point deadline) {
  std::lock_guard<std::mutex> hold(get_mu_);
  if (!settle()) {  // a get given up on still runs: no second one beside it
    std::lock_guard<std::mutex> g(mu_);
    ++counters_.tier_fetches_late;
    return;
  }
  if (from >= spec.keys.size()) return;
  // Where the loads check the pages' bytes (check_on_load), a round leaves only its records to
  // check after it: rounds of the whole buffer, as a put's, since each batch costs the client a
  // fixed time of its own. Where this thread checks them, rounds of half the buffer and an edge
  // round last, so that most of the checking runs while the next round crosses.
  const std::vector<std::size_t> plan =
      check_on_load_ ? plan_rounds(spec.keys.size() - from, kRing * round_pages_, Edge::kNone)
                     : plan_rounds(spec.keys.size() - from, round_pages_, Edge::kLast);
  // Rounds in flight behind the one being landed (Tier::gets_in_flight): each hangs under the
  // ones before it, still pending, and crosses while those are checked.
  const std::size_t depth = std::max<std::size_t>(1, tier_->gets_in_flight());
  std::deque<Round> flying;
  std::size_t r = 0, next_from = from;
  bool more = true;  // no round fell short or failed to be placed yet
  auto submit_next = [&] {
    if (!more || r >= plan.size() || next_from >= spec.keys.size()) return false;
    std::vector<Slot> pending;
    for (const Round& f : flying) pending.insert(pending.end(), f.slots.begin(), f.slots.end());
    std::optional<Round> round = submit_round(spec, next_from, plan[r++], pending);
    if (!round) return more = false;
    next_from = round->from + round->slots.size();
    if (round->slots.size() != round->asked) more = false;  // the prefix ends in it
    flying.push_back(std::move(*round));
    return true;
  };
  while (flying.size() < depth && submit_next()) {
  }
  while (!flying.empty()) {
    Round& current = flying.front();
    const bool whole = current.slots.size() == current.asked;
    const bool kept = land_round(spec, current, deadline, [&] {
      while (whole && flying.size() < depth + 1 && submit_next()) {
      }
    });
    flying.pop_front();
    if (!kept || !whole) {
      for (Round& f : flying) drop_round(f, deadline);
      return;
    }
  }
}

std::optional<TierLink::Round> TierLink::submit_round(const FetchSpec& spec, std::size_t from,
                                                      std::size_t n,
                                                      std::span<const Slot> pending) {
  Round round;
  round.from = from;
  round.asked = n;
  round.slots = host_.reserve(spec, from, n, pending);
  if (round.slots.empty()) return std::nullopt;
  std::vector<std::string> names;
  std::vector<std::byte*> dests;
  for (std::size_t j = 0; j < round.slots.size(); ++j) {
    if (!round.slots[j].fetch) continue;
    names.push_back(tier_value_name(space_, spec.keys[from + j]));
    dests.push_back(round.slots[j].bytes);
  }
  if (names.empty()) return round;  // host memory has every page: nothing to get
  try {
    std::lock_guard<std::mutex> t(tier_mu_);
    round.batch = tier_->get(names, dests, value_bytes_);
  } catch (const std::exception& e) {
    note_error(std::string("tier get: ") + e.what());
    host_.publish(round.slots, 0);
    return std::nullopt;
  }
  return round;
}

bool TierLink::land_round(const FetchSpec& spec, Round& round, Clock::time_point deadline,
                          const std::function<void()>& next) {
  std::vector<std::size_t> fetched;  // round indices of the pages got
  for (std::size_t j = 0; j < round.slots.size(); ++j) {
    if (round.slots[j].fetch) fetched.push_back(j);
  }
  std::vector<std::int64_t> results;
  if (round.batch >= 0) {
    std::optional<std::vector<std::int64_t>> r;
    try {
      r = wait(round.batch, deadline);
    } catch (const std::exception& e) {
      note_error(std::string("tier get: ") + e.what());
      r = std::vector<std::int64_t>(fetched.size(), Tier::kFailed);  // the backend forgot it
    }
    if (!r) {  // its slots stay pending until the get ends (settle)
      late_gets_.push_back({round.batch, std::move(round.slots)});
      std::lock_guard<std::mutex> g(mu_);
      ++counters_.tier_fetches_late;
      return false;
    }
    results = std::move(*r);
  }
  next();
  // Each value is checked where it landed (its record, then its page against the recorded
  // checksum, unless the page's first load will), on several threads for a large round; the
  // first page that fails ends what is kept.
  const auto B = static_cast<std::size_t>(block_tokens_);
  const Key root = tier_salt_digest(spec.salt);
  enum Verdict : char { kGood, kMissing, kRejected, kFailed };
  std::vector<char> verdict(fetched.size(), kFailed);
  std::vector<std::string> why(fetched.size());
  if (results.size() == fetched.size()) {
    // Records only (check_on_load): too little work for threads.
    detail::for_each_page(
        fetched.size(), check_on_load_ ? 0 : page_bytes_,
        [&](std::size_t k) {
          const std::int64_t x = results[k];
          if (x < 0) {
            verdict[k] = x == Tier::kMissing ? kMissing : kFailed;
            return;
          }
          const std::size_t i = round.from + fetched[k];
          const TierPage page = check_tier_record(
              {round.slots[fetched[k]].bytes, static_cast<std::size_t>(x)}, space_, spec.keys[i],
              i == 0 ? root : spec.keys[i - 1], spec.prompt.subspan(i * B, B), page_bytes_, why[k]);
          if (page.bytes.empty()) {
            verdict[k] = kRejected;
          } else if (check_on_load_) {
            round.slots[fetched[k]].unchecked = page.checksum;
            verdict[k] = kGood;
          } else if (page_checksum(page.bytes) != page.checksum) {
            why[k] = "page bytes do not match their checksum (overwritten or torn)";
            verdict[k] = kRejected;
          } else {
            verdict[k] = kGood;
          }
        },
        detail::kTierBytesPerThread, detail::kTierPageThreads);
  }
  const auto good = static_cast<std::size_t>(
      std::find_if(verdict.begin(), verdict.end(), [](char v) { return v != kGood; }) -
      verdict.begin());
  const std::size_t in_host = host_.publish(round.slots, good);
  if (good < fetched.size()) {
    std::lock_guard<std::mutex> g(mu_);
    switch (verdict[good]) {
      case kMissing:
        ++counters_.tier_pages_missing;
        break;
      case kRejected:
        ++counters_.tier_pages_rejected;
        counters_.tier_last_error = one_line("tier value rejected: " + why[good]);
        break;
      default:
        ++counters_.tier_errors;
        counters_.tier_last_error = "tier get failed";
    }
  }
  return in_host == round.slots.size();
}

void TierLink::drop_round(Round& round, Clock::time_point deadline) {
  if (round.batch >= 0) {
    std::optional<std::vector<std::int64_t>> r;
    try {
      r = wait(round.batch, deadline);
    } catch (const std::exception&) {
      r.emplace();  // the backend forgot it: nothing writes the slots any more
    }
    if (!r) {
      late_gets_.push_back({round.batch, std::move(round.slots)});
      return;
    }
  }
  host_.publish(round.slots, 0);
}

std::optional<std::vector<std::int64_t>> TierLink::wait(std::int64_t batch,
                                                        Clock::time_point deadline) {
  return detail::wait_for_batch(*tier_, tier_mu_, batch, deadline);
}

bool TierLink::settle() {
  std::vector<LateGet> ended;
  {
    std::lock_guard<std::mutex> t(tier_mu_);
    std::erase_if(late_gets_, [&](LateGet& late) {
      bool done = true;  // a backend that no longer knows it writes nothing for it any more
      try {
        done = tier_->poll(late.batch).has_value();
      } catch (const std::exception&) {
      }
      if (done) ended.push_back(std::move(late));
      return done;
    });
  }
  for (LateGet& late : ended) host_.publish(late.slots, 0);
  return late_gets_.empty();
}

void TierLink::note_rejected(const std::string& why) {
  std::lock_guard<std::mutex> g(mu_);
  ++counters_.tier_pages_rejected;
  counters_.tier_last_error = one_line("tier value rejected: " + why);
}

void TierLink::add_stats(CacheStats& s) const {
  std::int64_t memory_errors = 0;
  std::string memory_error;
  {
    std::lock_guard<std::mutex> g(gate_->errors_mu);
    memory_errors = gate_->memory_errors;
    memory_error = gate_->memory_error;
  }
  std::lock_guard<std::mutex> g(mu_);
  s.tier_pages_written = counters_.tier_pages_written;
  s.tier_pages_dropped = counters_.tier_pages_dropped;
  s.tier_pages_failed = counters_.tier_pages_failed;
  s.tier_pages_queued = counters_.tier_pages_queued;
  s.tier_pages_missing = counters_.tier_pages_missing;
  s.tier_pages_rejected = counters_.tier_pages_rejected;
  s.tier_fetches_late = counters_.tier_fetches_late;
  s.tier_errors = counters_.tier_errors + memory_errors;
  s.tier_last_error =
      one_line(counters_.tier_last_error.empty() ? memory_error : counters_.tier_last_error);
}

}  // namespace hicache
