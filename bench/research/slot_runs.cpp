// How many DMA pieces a store's and a load's pages need on a real workload: the host slots a
// store's pages get and a hit's pages sit in, replayed through HostPrefixCache itself (null
// copier) on a Mooncake-format trace.
//
// The staged path (the default for layer-major pools) sends each staging window's pages to their
// host slots as DMA pieces, one piece per run of slots that follow each other in memory once the
// window is sorted by host address, and loads them the same way (cpp/cuda/staging_lane.cu); the
// DMA path makes every chunk a piece of its own. Each piece costs the calling thread about
// 0.4-0.9 us (docs/performance.md, "Where a store of small pages spends its call"),
// so a store into slots scattered over the pool (the layout grid's shuffled pool: one piece a
// page) costs up to twice the CPU of one whose slots run together. This counts the pieces each
// store's and each load's copy calls would need on a trace, for windows of --window pages (0: a
// whole call).
//
// With --path dma it counts the DMA path's pieces instead (one-segment, page-major pools): pages
// in the call's order, a run of pages whose host slots and engine blocks both follow (or both
// precede) each other one piece, joined by the copier's own rule (cpp/cuda/dma_pieces.hpp); the
// counter says it joins runs (Copier::joins_runs), so each store gives its new pages their slots
// in their blocks' order (cpp/src/slot_order.hpp), as the CUDA copier's DMA path makes it do.
// Every request's pages get engine blocks 0, 1, 2...: an engine whose allocator hands a request
// consecutive blocks, the best case for runs. --slot-order 0 leaves the slots as the evictions
// freed them (the counter says it does not join runs, and still counts the runs there are).
//
//   build/<dir>/hicache_bench_slot_runs --trace data/traces/mooncake_conversation_trace.jsonl
//       [--block-tokens 16] [--capacity-tokens 1000000] [--window 64] [--requests 0]
//       [--admission adaptive|always] [--path staged|dma] [--slot-order 1|0]
//
// Each request is a lookup (try_resume, so that hits refresh what they use) then a store of its
// whole prompt, as an engine does after prefill; a trace block (512 tokens) is 512 distinct
// token ids derived from its hash id. Built with -DHICACHE_BUILD_BENCH=ON (no CUDA needed).
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <memory>
#include <numeric>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "dma_pieces.hpp"
#include "hicache/hicache.hpp"
#include "probe_args.hpp"

namespace {

using namespace hicache;

struct Request {
  std::int64_t input_length = 0;
  std::vector<std::int64_t> hash_ids;
};

// The two fields this needs from one line of a Mooncake trace (flat JSON of numbers).
std::optional<Request> parse(const std::string& line) {
  Request r;
  const auto len = line.find("\"input_length\"");
  const auto ids = line.find("\"hash_ids\"");
  if (len == std::string::npos || ids == std::string::npos) return std::nullopt;
  r.input_length = std::strtoll(line.c_str() + line.find(':', len) + 1, nullptr, 10);
  const char* p = line.c_str() + line.find('[', ids) + 1;
  while (*p != ']' && *p != '\0') {
    char* end = nullptr;
    const long long v = std::strtoll(p, &end, 10);
    if (end == p) {
      ++p;  // a comma or a space
      continue;
    }
    r.hash_ids.push_back(v);
    p = end;
  }
  return r;
}

// The null copier, counting the DMA pieces of each call's copies, by direction.
class PieceCounter : public NullCopier {
 public:
  PieceCounter(std::size_t slot_stride, std::size_t window, bool dma, bool slot_order)
      : slot_stride_(slot_stride), window_(window), dma_(dma), slot_order_(slot_order) {}

  bool joins_runs(const PageLayout&) const override { return dma_ && slot_order_; }

  void copy_pages(Direction dir, const PageLayout& layout, std::span<const PageMove> moves,
                  StreamHandle) override {
    Count& c = dir == Direction::kToHost ? stores : loads;
    if (dma_) return count_dma(dir, layout, moves, c);
    const std::size_t w = window_ == 0 ? moves.size() : window_;
    for (std::size_t i0 = 0; i0 < moves.size(); i0 += w) {
      hosts_.clear();
      for (std::size_t i = i0; i < std::min(moves.size(), i0 + w); ++i) {
        hosts_.push_back(reinterpret_cast<std::uintptr_t>(moves[i].host));
      }
      std::sort(hosts_.begin(), hosts_.end());
      std::int64_t pieces = 1;
      for (std::size_t i = 1; i < hosts_.size(); ++i) {
        pieces += hosts_[i] == hosts_[i - 1] + slot_stride_ ? 0 : 1;
      }
      c.pieces += pieces;
      c.pages += static_cast<std::int64_t>(hosts_.size());
    }
  }

  struct Count {
    std::int64_t pages = 0;
    std::int64_t pieces = 0;
    double per_page() const {
      return pages > 0 ? static_cast<double>(pieces) / static_cast<double>(pages) : 0.0;
    }
  };
  Count stores, loads;

 private:
  // The DMA path's pieces of one call (cuda_copier.cu, copy_pages_dma): the pieces of each full
  // batch of cuda::kDmaBatch, then of the rest.
  void count_dma(Direction dir, const PageLayout& layout, std::span<const PageMove> moves,
                 Count& c) {
    cuda::DmaPieces pieces(cuda::kDmaBatch);
    const auto bytes = static_cast<std::size_t>(layout.page_bytes());
    for (const PageMove& m : moves) {
      void* dev = layout.block_address(0, m.block);
      void* to = dir == Direction::kToHost ? static_cast<void*>(m.host) : dev;
      void* from = dir == Direction::kToHost ? dev : static_cast<void*>(m.host);
      if (!pieces.add(to, from, bytes, true)) {
        c.pieces += static_cast<std::int64_t>(pieces.size());
        pieces.clear();
        pieces.add(to, from, bytes, false);
      }
    }
    c.pieces += static_cast<std::int64_t>(pieces.size());
    c.pages += static_cast<std::int64_t>(moves.size());
  }

  std::size_t slot_stride_;
  std::size_t window_;
  bool dma_;
  bool slot_order_;
  std::vector<std::uintptr_t> hosts_;
};

}  // namespace

int main(int argc, char** argv) {
  using probe::arg;
  const std::string path = arg(argc, argv, "--trace", "");
  const long B = arg(argc, argv, "--block-tokens", 16L);
  const long capacity_tokens = arg(argc, argv, "--capacity-tokens", 1'000'000L);
  const long window = arg(argc, argv, "--window", 64L);
  const long limit = arg(argc, argv, "--requests", 0L);
  const std::string admission = arg(argc, argv, "--admission", "adaptive");
  const std::string copy_path = arg(argc, argv, "--path", "staged");
  const long slot_order = arg(argc, argv, "--slot-order", 1L);
  if (path.empty() || B < 1 || 512 % B != 0 || capacity_tokens < B || window < 0 ||
      (copy_path != "staged" && copy_path != "dma") || (slot_order != 0 && slot_order != 1)) {
    std::fprintf(
        stderr,
        "usage: --trace FILE [--block-tokens B (dividing 512)] [--capacity-tokens N] "
        "[--window PAGES (0: a whole call; the staged path)] [--requests N] "
        "[--admission adaptive|always] [--path staged|dma] [--slot-order 1|0 (the DMA path)]\n");
    return 2;
  }
  std::ifstream in(path);
  if (!in) {
    std::fprintf(stderr, "cannot open %s\n", path.c_str());
    return 2;
  }
  std::vector<Request> requests;
  for (std::string line; std::getline(in, line) && (limit == 0 || std::ssize(requests) < limit);) {
    if (auto r = parse(line)) requests.push_back(std::move(*r));
  }
  std::int64_t most_pages = 1;
  for (const Request& r : requests) most_pages = std::max(most_pages, r.input_length / B + 1);

  // A slot is its page (no tier record, and pages a multiple of the slots' alignment), so
  // adjacent slots are a page apart.
  constexpr std::size_t kPageBytes = 256;
  static_assert(kPageBytes % HostPool::kSlotAlign == 0);
  std::vector<std::byte> kv(static_cast<std::size_t>(most_pages) * kPageBytes);  // never touched
  CacheConfig config;
  config.block_tokens = B;
  config.capacity_pages = capacity_tokens / B;
  config.admission = parse_admission(admission);
  auto counter = std::make_shared<PieceCounter>(kPageBytes, static_cast<std::size_t>(window),
                                                copy_path == "dma", slot_order == 1);
  HostPrefixCache cache({Segment{kv.data(), most_pages, kPageBytes, kPageBytes}}, Device{}, config,
                        counter);
  std::vector<std::int64_t> blocks(static_cast<std::size_t>(most_pages));
  std::iota(blocks.begin(), blocks.end(), 0);

  std::vector<std::int32_t> prompt;
  std::int64_t stores_with_pages = 0;
  for (const Request& r : requests) {
    prompt.clear();
    for (std::int64_t h : r.hash_ids) {
      for (std::int64_t j = 0; j < 512 && std::ssize(prompt) < r.input_length; ++j) {
        prompt.push_back(static_cast<std::int32_t>((h * 512 + j) & 0x7fffffff));
      }
    }
    if (prompt.empty()) continue;
    cache.try_resume("r", prompt, [&](std::int64_t tokens) {
      return std::vector<std::int64_t>(blocks.begin(), blocks.begin() + tokens / B);
    });
    cache.poll();
    cache.forget("r");
    const std::int64_t before = counter->stores.pages;
    cache.store("r", prompt, blocks);
    cache.poll();
    cache.forget("r");
    stores_with_pages += counter->stores.pages > before ? 1 : 0;
  }
  const CacheStats s = cache.stats();
  const auto& st = counter->stores;
  const auto& ld = counter->loads;
  std::string counted = "the DMA path's runs";
  if (copy_path == "dma" && slot_order == 0) counted += ", slots as freed";
  if (copy_path == "staged") {
    counted = "staging windows of " +
              (window == 0 ? std::string("a whole call") : std::to_string(window) + " pages");
  }
  std::printf(
      "%s: %zu requests, %ld-token pages, %ld tokens of host memory, admission %s, %s: stores %lld "
      "pages (%lld stores) in %lld DMA pieces (%.3f a page); loads %lld pages in "
      "%lld pieces (%.3f a page); %lld pages evicted\n",
      path.c_str(), requests.size(), B, capacity_tokens, admission.c_str(), counted.c_str(),
      static_cast<long long>(st.pages), static_cast<long long>(stores_with_pages),
      static_cast<long long>(st.pieces), st.per_page(), static_cast<long long>(ld.pages),
      static_cast<long long>(ld.pieces), ld.per_page(), static_cast<long long>(s.pages_evicted));
  return 0;
}
