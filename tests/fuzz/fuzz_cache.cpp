// libFuzzer target for the C++ entry points, built with clang and instrumented for coverage, ASan
// and UBSan (HICACHE_BUILD_FUZZER). Each input is decoded into a cache configuration and a
// sequence of operations: store, try_resume with any block ids (out of range, duplicates, wrong
// count), deferral, poll, forget of known and unknown ids, completing a stream.
//
// Oracle: the engine's blocks and states hold bytes derived from the token prefix they belong to,
// so every page and state the cache serves is checked against the prefix it was served for
// (exactness, also with 1- to 3-bit keys where collisions are constant: with them, removing the
// token comparison from the cache is caught within seconds; with 3-bit keys alone it survived
// 60 s). Accounting is checked after every operation. Anything but the documented exceptions
// aborts.
//
//   build/fuzz/hicache_fuzz -runs=50000 -max_len=512 -len_control=0   (as in the test command)

#include <fuzzer/FuzzedDataProvider.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "fuzz_engine.hpp"
#include "hicache/hicache.hpp"

const char* const hicache_fuzz::kTarget = "hicache fuzz";

namespace {

using hicache_fuzz::digest;
using hicache_fuzz::fail;
using hicache_fuzz::kB;
using hicache_fuzz::kBlocks;
using hicache_fuzz::kBytes;
constexpr std::int64_t kStateBytes = 8;

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  FuzzedDataProvider fdp(data, size);
  const bool deferred = fdp.ConsumeBool();
  const bool with_state = fdp.ConsumeBool();
  hicache::CacheConfig cfg;
  cfg.block_tokens = kB;
  cfg.capacity_pages = fdp.ConsumeIntegralInRange<std::int64_t>(1, 8);
  cfg.keep_tokens = fdp.ConsumeIntegralInRange<std::int64_t>(1, 6);
  cfg.key_bits = fdp.ConsumeBool() ? fdp.ConsumeIntegralInRange(1, 3) : 128;
  cfg.eviction =
      fdp.ConsumeBool() ? hicache::EvictionPolicy::kLru : hicache::EvictionPolicy::kLeafFirst;
  if (with_state) {
    cfg.state_bytes = kStateBytes;
    cfg.capacity_states = 2;
  }
  std::vector<std::uint64_t> blocks(kBlocks, 0);
  std::vector<hicache::Segment> segs{{blocks.data(), kBlocks, kBytes, kBytes}};
  std::shared_ptr<hicache::DeferredCopier> dc;
  std::shared_ptr<hicache::Copier> copier;
  if (deferred) {
    dc = std::make_shared<hicache::DeferredCopier>();
    copier = dc;
  } else {
    copier = std::make_shared<hicache::CpuCopier>();
  }
  hicache::HostPrefixCache cache(segs, {}, cfg, copier);
  std::uint64_t state_buf = 0;  // staging buffer for states
  std::uint64_t state_in = 0;   // receives states: alive until every transfer into it completed
  std::vector<std::uint64_t> exported(64, 0);

  // Stop when the input is used up: past its end every value would read as zero.
  for (int step = 0; step < 64 && fdp.remaining_bytes() > 0; ++step) {
    const int op = fdp.ConsumeIntegralInRange(0, 4);
    const std::string rid = "r" + std::to_string(fdp.ConsumeIntegralInRange(0, 3));
    const std::vector<std::int32_t> prompt = hicache_fuzz::decode_prompt(fdp);
    // Mostly a well-formed block table; sometimes anything at all.
    std::vector<std::int64_t> ids;
    const bool well_formed = fdp.ConsumeIntegralInRange(0, 7) != 0;
    if (well_formed) {
      ids = hicache_fuzz::rotated_block_table(
          prompt.size(), fdp.ConsumeIntegralInRange<std::int64_t>(0, kBlocks - 1));
    } else {
      for (int i = fdp.ConsumeIntegralInRange(0, 6); i > 0; --i) {
        ids.push_back(fdp.ConsumeIntegralInRange<std::int64_t>(-1, kBlocks));
      }
    }
    auto* stream = reinterpret_cast<hicache::StreamHandle>(fdp.ConsumeIntegralInRange(0, 1));
    // With asynchronous copies the harness would have to keep blocks stable until completion,
    // as an engine does; the byte oracle runs with the synchronous copier.
    const bool oracle = !deferred;
    try {
      if (op == 0) {
        const auto n_full = static_cast<std::int64_t>(prompt.size()) / kB;
        for (std::int64_t i = 0; i < n_full && i < static_cast<std::int64_t>(ids.size()); ++i) {
          if (ids[i] >= 0 && ids[i] < kBlocks)
            blocks[ids[i]] = digest(prompt, (i + 1) * kB);  // prefill
        }
        hicache::HostPrefixCache::StateExportFn exp =
            [&](std::int64_t pos) -> std::optional<hicache::DeviceBuffer> {
          exported[static_cast<std::size_t>(pos % 64)] =
              digest(prompt, static_cast<std::size_t>(pos));
          state_buf = exported[static_cast<std::size_t>(pos % 64)];
          return hicache::DeviceBuffer{&state_buf, kStateBytes, {}};
        };
        bool distinct = true;  // the same block written for two pages would break the oracle
        for (std::size_t i = 0; i < ids.size(); ++i)
          for (std::size_t j = i + 1; j < ids.size(); ++j) distinct &= ids[i] != ids[j];
        if (!distinct && oracle) continue;
        cache.store(rid, prompt, ids, stream,
                    with_state ? exp : hicache::HostPrefixCache::StateExportFn{});
      } else if (op == 1) {
        const bool refuse = fdp.ConsumeBool();
        state_in = 0;
        std::optional<hicache::DeviceBuffer> state_out;
        if (with_state) state_out = hicache::DeviceBuffer{&state_in, kStateBytes, {}};
        const std::int64_t got = cache.try_resume(
            rid, prompt,
            [&](std::int64_t tokens) -> std::optional<std::vector<std::int64_t>> {
              if (refuse) return std::nullopt;
              if (static_cast<std::int64_t>(ids.size()) * kB > tokens && tokens > 0 &&
                  well_formed) {
                return std::vector<std::int64_t>(ids.begin(), ids.begin() + tokens / kB);
              }
              return ids;
            },
            stream, state_out);
        if (got > 0 && oracle) {
          for (std::int64_t i = 0; i < got / kB; ++i) {
            if (blocks[static_cast<std::size_t>(ids[static_cast<std::size_t>(i)])] !=
                digest(prompt, (i + 1) * kB)) {
              fail("a served page is not the KV of its prefix");
            }
          }
          if (with_state && state_in != digest(prompt, static_cast<std::size_t>(got))) {
            fail("a served state is not the state of its prefix");
          }
        }
        if (got > 0 && got % kB != 0) fail("a hit that is not a whole number of pages");
        if (got > 0 && got > static_cast<std::int64_t>(prompt.size()) - cfg.keep_tokens)
          fail("keep_tokens cap broken");
      } else if (op == 2) {
        cache.poll();
      } else if (op == 3) {
        cache.forget(rid);
      } else if (dc) {
        if (fdp.ConsumeBool()) {
          dc->complete();
        } else {
          dc->complete(stream);
        }
      }
    } catch (const hicache::UnknownRequest&) {
    } catch (const std::invalid_argument&) {
    } catch (const std::out_of_range&) {
    }
    const hicache::CacheStats s = cache.stats();
    if (s.pages_used > s.pages_capacity || s.pages_busy > s.pages_used) fail("page accounting");
    if (s.states_used > s.states_capacity || s.states_busy > s.states_used)
      fail("state accounting");
    if (s.errors != 0) fail("a cache error without any fault injected");
  }
  if (dc) dc->complete();
  cache.poll();
  const hicache::CacheStats s = cache.stats();
  if (s.pages_busy != 0 || s.states_busy != 0 || s.transfers_in_flight != 0)
    fail("held after draining");
  return 0;
}
