// Layer-wise loads (layerwise_load.hpp) and the load-or-recompute decision
// (load_or_recompute.hpp), on CPU segments with the deferred copier standing in for a device.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <thread>

#include "fake_engine.hpp"
#include "hicache/hicache.hpp"
#include "test_support.hpp"

namespace {

using hicache::LayerwiseLoad;
using hicache::LoadCost;
using hicache::pages_worth_loading;
using hicache::PrefillSeconds;
using hicache::StreamHandle;
using hicache_test::FakeEngine;
using hicache_test::give;
using hicache_test::ids;
using hicache_test::small_config;
using hicache_test::tokens;

// Three layers of two segments (K and V), each of its own size, so a copy of the wrong segment
// range shows in the bytes.
FakeEngine three_layers(std::int64_t blocks) {
  return FakeEngine(blocks, {64, 64, 32, 32, 16, 16});
}

std::vector<std::uint8_t> segment_bytes(const FakeEngine& eng, std::int64_t block, std::size_t s) {
  const auto& seg = eng.segments()[s];
  const auto* p = static_cast<const std::uint8_t*>(seg.base) + block * seg.block_stride;
  return {p, p + seg.block_bytes};
}

const auto kCopyStream = reinterpret_cast<StreamHandle>(0x1);
const auto kComputeStream = reinterpret_cast<StreamHandle>(0x2);

}  // namespace

TEST(Layerwise, EachLayerArrivesUnderItsOwnFenceAndThePagesStayHeldUntilTheLast) {
  FakeEngine eng = three_layers(8);
  auto copier = std::make_shared<hicache::DeferredCopier>();
  hicache::CacheConfig c = small_config(4);
  c.layer_segments = {2, 2, 2};
  hicache::HostPrefixCache cache(eng.segments(), {}, c, copier);
  for (std::int64_t b = 0; b < 2; ++b) eng.fill(b, static_cast<std::uint32_t>(40 + b));
  const auto prompt = tokens(2 * 16 + 1);
  ASSERT_EQ(cache.store("s", prompt, ids(0, 2)), 2);
  copier->complete();
  cache.poll();

  LayerwiseLoad load;
  ASSERT_EQ(cache.try_resume("r", prompt, give(ids(4, 2)), kCopyStream, std::nullopt, std::nullopt,
                             &load),
            32);
  EXPECT_EQ(load.tokens(), 32);
  ASSERT_EQ(load.layers(), 3u);
  EXPECT_EQ(cache.stats().layerwise_loads, 1);
  for (std::size_t l = 0; l < 3; ++l) EXPECT_FALSE(load.ready(l));

  copier->complete_next(kCopyStream);  // layer 0's copy (one call for both pages)
  EXPECT_TRUE(load.ready(0));
  EXPECT_FALSE(load.ready(1));
  for (std::int64_t b = 0; b < 2; ++b) {
    for (std::size_t s = 0; s < 6; ++s) {
      SCOPED_TRACE(testing::Message() << "block " << b << " segment " << s);
      const bool arrived = s < 2;  // the other layers' bytes are still the engine's zeros
      EXPECT_EQ(segment_bytes(eng, 4 + b, s) == segment_bytes(eng, b, s), arrived);
    }
  }
  cache.poll();
  EXPECT_EQ(cache.stats().pages_busy, 2);  // held until the whole load is done

  load.wait(2, kComputeStream);  // the CPU stand-in blocks until layer 2 is there
  EXPECT_TRUE(load.ready(1));
  EXPECT_TRUE(load.ready(2));
  EXPECT_EQ(eng.page(4), eng.page(0));
  EXPECT_EQ(eng.page(5), eng.page(1));
  cache.poll();
  EXPECT_EQ(cache.stats().pages_busy, 0);
  EXPECT_THROW(load.ready(3), std::out_of_range);
  EXPECT_TRUE(eng.canaries_intact());
}

namespace {

// A deferred copier whose layer copies fail while `fail` is set.
class FailingLayers : public hicache::DeferredCopier {
 public:
  void copy_segments(hicache::Direction d, const hicache::PageLayout& l,
                     std::span<const hicache::PageMove> m, std::size_t first, std::size_t last,
                     StreamHandle s) override {
    if (fail) throw hicache::Error("planned layer failure");
    DeferredCopier::copy_segments(d, l, m, first, last, s);
  }
  bool fail = false;
};

// A cache of three layers holding blocks 0 and 1 (filled), with `ahead` bytes issued ahead.
struct Stored {
  explicit Stored(std::size_t ahead, std::shared_ptr<hicache::DeferredCopier> c = nullptr)
      : eng(three_layers(8)),
        copier(c ? std::move(c) : std::make_shared<hicache::DeferredCopier>()),
        cache(std::make_unique<hicache::HostPrefixCache>(eng.segments(), hicache::Device{},
                                                         config(ahead), copier)) {
    for (std::int64_t b = 0; b < 2; ++b) eng.fill(b, static_cast<std::uint32_t>(60 + b));
    EXPECT_EQ(cache->store("s", prompt, ids(0, 2)), 2);
    copier->complete();
    cache->poll();
  }
  static hicache::CacheConfig config(std::size_t ahead) {
    hicache::CacheConfig c = small_config(4);
    c.layer_segments = {2, 2, 2};
    c.layer_issue_ahead_bytes = ahead;
    return c;
  }
  // Whether layer l of the resumed blocks 4 and 5 holds what was stored.
  bool arrived(std::size_t l) const {
    bool all = true;
    for (std::int64_t b = 0; b < 2; ++b) {
      for (std::size_t s = 2 * l; s < 2 * l + 2; ++s) {
        all = all && segment_bytes(eng, 4 + b, s) == segment_bytes(eng, b, s);
      }
    }
    return all;
  }
  FakeEngine eng;
  std::shared_ptr<hicache::DeferredCopier> copier;
  std::unique_ptr<hicache::HostPrefixCache> cache;
  std::vector<std::int32_t> prompt = tokens(2 * 16 + 1);
};

}  // namespace

TEST(Layerwise, LaterLayersAreIssuedOnlyAsTheEngineAsksForThem) {
  Stored st(/*ahead=*/0);
  LayerwiseLoad load;
  ASSERT_EQ(st.cache->try_resume("r", st.prompt, give(ids(4, 2)), kCopyStream, std::nullopt,
                                 std::nullopt, &load),
            32);
  ASSERT_EQ(load.layers(), 3u);
  // Only layer 0 was submitted: completing everything queued lands layer 0 and nothing else.
  EXPECT_EQ(st.copier->pending(), 1u);
  st.copier->complete();
  EXPECT_TRUE(st.arrived(0));
  EXPECT_FALSE(st.arrived(1));
  EXPECT_FALSE(st.arrived(2));
  st.cache->poll();
  EXPECT_EQ(st.cache->stats().pages_busy, 2);  // held: layers 1 and 2 are still to come
  EXPECT_FALSE(load.ready(1));                 // asking issues it
  EXPECT_EQ(st.copier->pending(), 1u);
  st.copier->complete();
  EXPECT_TRUE(load.ready(1));
  EXPECT_TRUE(st.arrived(1));
  EXPECT_FALSE(st.arrived(2));
  load.wait(2, kComputeStream);  // issues layer 2; the CPU stand-in blocks until it is there
  EXPECT_TRUE(st.arrived(2));
  st.cache->poll();
  EXPECT_EQ(st.cache->stats().pages_busy, 0);
  EXPECT_EQ(st.eng.page(4), st.eng.page(0));
  EXPECT_EQ(st.eng.page(5), st.eng.page(1));

  // With `ahead` bytes, the layers whose bytes fit behind the one asked for go with it: layer 1
  // is 2 pages x 2 x 32 bytes.
  Stored ahead(/*ahead=*/128);
  LayerwiseLoad l2;
  ahead.cache->try_resume("r", ahead.prompt, give(ids(4, 2)), kCopyStream, std::nullopt,
                          std::nullopt, &l2);
  EXPECT_EQ(ahead.copier->pending(), 2u);  // layers 0 and 1
  ahead.copier->complete();
  EXPECT_TRUE(ahead.arrived(1));
  EXPECT_FALSE(ahead.arrived(2));
  l2.synchronize();  // issues the rest
  EXPECT_TRUE(ahead.arrived(2));
  // SIZE_MAX issues every layer in try_resume.
  Stored all(SIZE_MAX);
  LayerwiseLoad l3;
  all.cache->try_resume("r", all.prompt, give(ids(4, 2)), kCopyStream, std::nullopt, std::nullopt,
                        &l3);
  EXPECT_EQ(all.copier->pending(), 3u);
}

TEST(Layerwise, ADroppedLoadIssuesNothingMoreAndReleasesItsPages) {
  Stored st(/*ahead=*/0);
  {
    LayerwiseLoad load;
    st.cache->try_resume("r", st.prompt, give(ids(4, 2)), kCopyStream, std::nullopt, std::nullopt,
                         &load);
    EXPECT_FALSE(load.ready(1));  // layers 0 and 1 issued
  }
  st.cache->poll();
  EXPECT_EQ(st.cache->stats().pages_busy, 2);  // until the issued copies complete
  EXPECT_EQ(st.copier->complete(), 2u);
  st.cache->poll();
  EXPECT_EQ(st.cache->stats().pages_busy, 0);
  EXPECT_TRUE(st.arrived(1));
  EXPECT_FALSE(st.arrived(2));  // never issued, never written
  EXPECT_EQ(st.copier->pending(), 0u);
  // Reusing a load object for another hit gives up the first one the same way.
  LayerwiseLoad load;
  st.cache->try_resume("a", st.prompt, give(ids(4, 2)), kCopyStream, std::nullopt, std::nullopt,
                       &load);
  st.cache->try_resume("b", st.prompt, give(ids(6, 2)), kCopyStream, std::nullopt, std::nullopt,
                       &load);
  st.copier->complete();
  load.synchronize();
  st.cache->poll();
  EXPECT_EQ(st.cache->stats().pages_busy, 0);
  EXPECT_EQ(st.eng.page(6), st.eng.page(0));
  EXPECT_TRUE(st.eng.canaries_intact());
}

TEST(Layerwise, TheCacheGoingFirstEndsTheLoadWithAnError) {
  Stored st(/*ahead=*/0);
  LayerwiseLoad load;
  st.cache->try_resume("r", st.prompt, give(ids(4, 2)), kCopyStream, std::nullopt, std::nullopt,
                       &load);
  st.copier->complete();
  st.cache.reset();  // waits for what was issued, issues nothing more
  EXPECT_TRUE(load.ready(0));
  try {
    load.wait(1, kComputeStream);
    FAIL() << "a layer of a destroyed cache was waited for";
  } catch (const hicache::Error& e) {
    EXPECT_NE(std::string(e.what()).find("the cache was destroyed first"), std::string::npos)
        << e.what();
  }
  EXPECT_EQ(st.copier->pending(), 0u);
  EXPECT_FALSE(st.arrived(1));
}

TEST(Layerwise, ALayerThatCannotBeIssuedFailsItsWaitAndIsCounted) {
  auto copier = std::make_shared<FailingLayers>();
  Stored st(/*ahead=*/0, copier);
  LayerwiseLoad load;
  st.cache->try_resume("r", st.prompt, give(ids(4, 2)), kCopyStream, std::nullopt, std::nullopt,
                       &load);
  copier->fail = true;
  for (int i = 0; i < 2; ++i) {  // the same error each time it is asked
    try {
      load.wait(1, kComputeStream);
      FAIL() << "a layer whose copy failed was waited for";
    } catch (const hicache::Error& e) {
      EXPECT_NE(std::string(e.what()).find("layer 1 of a layer-wise load could not be issued: "
                                           "planned layer failure"),
                std::string::npos)
          << e.what();
    }
  }
  EXPECT_THROW(load.ready(2), hicache::Error);
  copier->fail = false;
  EXPECT_EQ(st.cache->stats().errors, 1);
  copier->complete();
  st.cache->poll();
  EXPECT_EQ(st.cache->stats().pages_busy, 0);  // released once layer 0's copy completed
  EXPECT_TRUE(st.arrived(0));
  EXPECT_FALSE(st.arrived(1));
  // Failing in try_resume itself is a miss, as for any copy.
  copier->fail = true;
  LayerwiseLoad miss;
  EXPECT_EQ(st.cache->try_resume("m", st.prompt, give(ids(6, 2)), kCopyStream, std::nullopt,
                                 std::nullopt, &miss),
            0);
  EXPECT_EQ(miss.layers(), 0u);
  EXPECT_EQ(st.cache->stats().errors, 2);
}

TEST(Layerwise, AMissHasNothingToWaitFor) {
  FakeEngine eng = three_layers(8);
  hicache::CacheConfig c = small_config(4);
  c.layer_segments = {2, 2, 2};
  hicache::HostPrefixCache cache(eng.segments(), {}, c);
  LayerwiseLoad load;
  EXPECT_EQ(cache.try_resume("r", tokens(40), give(ids(0, 2)), nullptr, std::nullopt, std::nullopt,
                             &load),
            0);
  EXPECT_EQ(load.layers(), 0u);
  EXPECT_TRUE(load.ready(7));
  load.wait(7, kComputeStream);
  load.synchronize();
  // A deferral says so, as try_resume does.
  for (std::int64_t b = 0; b < 2; ++b) eng.fill(b, static_cast<std::uint32_t>(b));
  cache.store("s", tokens(40), ids(0, 2));
  cache.poll();
  const auto defer = [](std::int64_t) -> std::optional<std::vector<std::int64_t>> {
    return std::nullopt;
  };
  EXPECT_EQ(cache.try_resume("d", tokens(40), defer, nullptr, std::nullopt, std::nullopt, &load),
            -1);
  EXPECT_EQ(load.tokens(), -1);
  EXPECT_EQ(load.layers(), 0u);
}

TEST(Layerwise, LayerSegmentsAreCheckedAndRequired) {
  FakeEngine eng = three_layers(8);
  hicache::CacheConfig c = small_config(4);
  c.layer_segments = {2, 2};
  try {
    hicache::HostPrefixCache bad(eng.segments(), {}, c);
    FAIL() << "layer_segments adding up to 4 of 6 segments was accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("layer_segments must add up to the 6 segments"),
              std::string::npos)
        << e.what();
  }
  c.layer_segments = {2, 0, 4};
  EXPECT_THROW(hicache::HostPrefixCache(eng.segments(), {}, c), std::invalid_argument);
  hicache::HostPrefixCache plain(eng.segments(), {}, small_config(4));
  LayerwiseLoad load;
  EXPECT_THROW(plain.try_resume("r", tokens(40), give(ids(0, 2)), nullptr, std::nullopt,
                                std::nullopt, &load),
               std::invalid_argument);
}

TEST(LoadOrRecompute, LoadedFirstTheBestIsAllOrNothingAndOverlappedItIsWhereBothTakeAsLong) {
  // One token a page, a page loads in 1 s, a token prefills in 0.5 s: loading first never pays.
  const PrefillSeconds prefill = [](std::int64_t start, std::int64_t end) {
    return 0.5 * static_cast<double>(end - start);
  };
  LoadCost cost{1, 100, 1.0, 1, &prefill};
  EXPECT_EQ(pages_worth_loading(100, cost), 0u);
  // Layer by layer (10 layers): max(h, (100 - h) / 2) + min(...) / 10 is least at h = 33.
  cost.layers = 10;
  EXPECT_EQ(pages_worth_loading(100, cost), 33u);
  EXPECT_EQ(pages_worth_loading(100, cost, /*whole_or_nothing=*/true), 0u);
  // A link ten times faster: loaded first, every page is worth it; overlapped, the last 16
  // tokens compute while the 84 pages before them load (8.4 s + 0.8 s, against 10 s for all).
  cost.page_load_s = 0.1;
  EXPECT_EQ(pages_worth_loading(100, cost), 84u);
  cost.layers = 1;
  EXPECT_EQ(pages_worth_loading(100, cost), 100u);
  // No prefill model or no measured rate: the whole hit.
  cost.page_load_s = 0;
  EXPECT_EQ(pages_worth_loading(100, cost), 100u);
  LoadCost none{1, 100, 1.0, 1, nullptr};
  EXPECT_EQ(pages_worth_loading(100, none), 100u);
}

TEST(LoadOrRecompute, TheCacheServesAHitOnlyWhenLoadingItIsFaster) {
  FakeEngine eng(8, {4096});
  double tokens_per_s = 1e3;  // a slow engine at first: loading wins
  hicache::CacheConfig c = small_config(4);
  c.prefill_seconds = [&](std::int64_t start, std::int64_t end) {
    return static_cast<double>(end - start) / tokens_per_s;
  };
  hicache::HostPrefixCache cache(eng.segments(), {}, c);
  for (std::int64_t b = 0; b < 2; ++b) eng.fill(b, static_cast<std::uint32_t>(90 + b));
  const auto prompt = tokens(2 * 16 + 1);
  ASSERT_EQ(cache.store("s", prompt, ids(0, 2)), 2);
  cache.poll();
  // Nothing measured yet: served (and measured).
  EXPECT_EQ(cache.stats().load_bytes_per_s, 0.0);
  EXPECT_EQ(cache.try_resume("a", prompt, give(ids(2, 2))), 32);
  const double rate = cache.stats().load_bytes_per_s;
  EXPECT_GT(rate, 0.0);
  EXPECT_EQ(cache.try_resume("b", prompt, give(ids(4, 2))), 32);
  EXPECT_EQ(cache.stats().hits_trimmed, 0);
  // An engine that prefills a page's tokens far faster than the page loads: recomputed.
  tokens_per_s = 1e6 * rate;
  EXPECT_EQ(cache.try_resume("c", prompt, give(ids(6, 2))), 0);
  auto s = cache.stats();
  EXPECT_EQ(s.hits_trimmed, 1);
  EXPECT_EQ(s.pages_recomputed, 2);
  EXPECT_EQ(s.pages_busy, 0);  // nothing held by the declined hit
  EXPECT_EQ(s.hits, 2);
}

TEST(CopyRate, CountsTheTimeLoadsTookFollowsASlowerLinkAndForgetsAStaleRate) {
  hicache::CopyRate rate(/*half_life_bytes=*/1e6, /*stale_after_s=*/0.2);
  EXPECT_EQ(rate.bytes_per_s(), 0.0);
  rate.add(1'000'000, 0.001);  // 1 GB/s
  EXPECT_DOUBLE_EQ(rate.bytes_per_s(), 1e9);
  rate.add(1'000'000, 0.003);  // one that waited behind other copies: the time counts
  EXPECT_NEAR(rate.bytes_per_s(), 1.5e6 / 0.0035, 1.0);   // the first weighs half (half-life)
  for (int i = 0; i < 8; ++i) rate.add(1'000'000, 0.01);  // the link slowed to 0.1 GB/s
  EXPECT_LT(rate.bytes_per_s(), 0.11e9);
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  EXPECT_EQ(rate.bytes_per_s(), 0.0);  // stale: measured again at the next load
}
