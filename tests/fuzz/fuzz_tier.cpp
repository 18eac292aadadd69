// libFuzzer targets for the tier's seam (HICACHE_BUILD_FUZZER, clang, coverage + ASan + UBSan):
// two caches ("hosts") over one tier: a MemoryTier (hicache_fuzz_tier) or a DiskTier of a few
// small segments (hicache_fuzz_disk_tier, built with HICACHE_FUZZ_DISK_TIER). Each input is
// decoded into the tier, the caches' configurations and a sequence of operations on either
// host: store, try_resume (waiting for the tier or prefetching, whole or layer by layer),
// prefetch, poll, forget, flush; and on the tier: in memory, a value's byte flipped (in its
// page or anywhere), the value cut short, lengthened, replaced by another value's bytes or
// erased, and calls that fail; on disk, a byte of a segment, index or format file flipped under
// the running tier, and both engines and the tier restarted over the directory.
//
// Oracle: the engine's blocks hold bytes derived from the salt and token prefix they belong to,
// so every page either host serves is checked against the prefix and salt it was served for, as
// fuzz_cache.cpp does for one host: whatever the tier returns, a page is the KV of its own
// prefix or it is not served. Accounting is checked after every operation, and a tier's faults
// must never count as the cache's own errors.
//
//   build/fuzz/hicache_fuzz_tier -max_total_time=60 -max_len=512 -len_control=0
//   build/fuzz/hicache_fuzz_disk_tier -max_total_time=60 -max_len=512 -len_control=0 -entropic=0
//
// (-entropic=0 on disk: the disk tier's threads make coverage vary from run to run, and
// libFuzzer's entropic scheduling spent 60 % of the time weighing it: 63 against 148 inputs a
// second on the 2-core machine, when one target did both.)

#include <fuzzer/FuzzedDataProvider.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "fuzz_engine.hpp"
#include "hicache/hicache.hpp"

const char* const hicache_fuzz::kTarget = "hicache tier fuzz";

namespace {

using hicache_fuzz::digest;  // with a salt: two tenants' models differ
using hicache_fuzz::fail;
using hicache_fuzz::kB;
using hicache_fuzz::kBlocks;  // a host's
using hicache_fuzz::kBytes;

struct Host {
  std::vector<std::uint64_t> blocks = std::vector<std::uint64_t>(kBlocks, 0);
  hicache::CacheConfig cfg;
  std::unique_ptr<hicache::HostPrefixCache> cache;

  void open(const std::shared_ptr<hicache::Tier>& tier) {
    std::vector<hicache::Segment> segs{{blocks.data(), kBlocks, kBytes, kBytes}};
    cache = std::make_unique<hicache::HostPrefixCache>(
        segs, hicache::Device{}, cfg, std::make_shared<hicache::CpuCopier>(), tier);
  }
};

// A disk tier's directory for one input: unique to this process and input (two runs on one
// machine never share one), removed after it.
struct ScratchDir {
  std::filesystem::path path;
  ScratchDir() {
    static int inputs = 0;
    path = std::filesystem::temp_directory_path() /
           ("hicache-fuzz-tier-" + std::to_string(getpid()) + "-" + std::to_string(inputs++));
  }
  ~ScratchDir() {
    std::error_code ignored;
    std::filesystem::remove_all(path, ignored);
  }
};

// Flips a byte of one of the directory's files (a segment, its index file, the format file)
// while the tier may have it open; the lock file is left alone.
void damage_a_file(const std::filesystem::path& dir, std::size_t which, std::uint32_t at,
                   unsigned char bits) {
  std::vector<std::filesystem::path> files;
  std::error_code ec;
  for (const auto& e : std::filesystem::recursive_directory_iterator(dir, ec)) {
    if (e.is_regular_file(ec) && e.path().filename() != "LOCK") files.push_back(e.path());
  }
  if (files.empty()) return;
  std::sort(files.begin(), files.end());
  std::fstream f(files[which % files.size()], std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(0, std::ios::end);
  const auto size = static_cast<std::uint32_t>(f.tellg());
  if (!f || size == 0) return;
  char c = 0;
  f.seekg(at % size);
  f.read(&c, 1);
  c = static_cast<char>(static_cast<unsigned char>(c) ^ bits);
  f.seekp(at % size);
  f.write(&c, 1);
}

// Two targets of this file: in memory (hicache_fuzz_tier) and on disk (hicache_fuzz_disk_tier).
// One target choosing per input reached a damaged page in a layer-wise cache 2-4 times slower.
#ifdef HICACHE_FUZZ_DISK_TIER
constexpr bool kOnDisk = true;
#else
constexpr bool kOnDisk = false;
#endif

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  FuzzedDataProvider fdp(data, size);
  // The tier: in memory (its values damaged by hand, its calls failing), or a directory (its
  // files damaged, the tier and both caches restarted over it), of 2 to 16 segments of 1 to 4
  // blocks of 4 KiB: segments fill, rotate and go within a few stores.
  std::shared_ptr<hicache::MemoryTier> memory;
  std::optional<ScratchDir> dir;
  hicache::DiskTierOptions disk;
  std::shared_ptr<hicache::Tier> tier;
  if (!kOnDisk) {
    memory = std::make_shared<hicache::MemoryTier>();
    tier = memory;
  } else {
    dir.emplace();
    disk.path = dir->path.string();
    disk.segment_bytes = 4096 * fdp.ConsumeIntegralInRange<std::int64_t>(1, 4);
    disk.capacity_bytes = disk.segment_bytes * fdp.ConsumeIntegralInRange<std::int64_t>(2, 16);
    disk.read_threads = fdp.ConsumeIntegralInRange(1, 3);
    tier = std::make_shared<hicache::DiskTier>(disk);
  }
  Host hosts[2];
  for (Host& h : hosts) {
    hicache::CacheConfig& cfg = h.cfg;
    cfg.block_tokens = kB;
    cfg.capacity_pages = fdp.ConsumeIntegralInRange<std::int64_t>(1, 8);
    cfg.keep_tokens = fdp.ConsumeIntegralInRange<std::int64_t>(1, 6);
    cfg.eviction =
        fdp.ConsumeBool() ? hicache::EvictionPolicy::kLru : hicache::EvictionPolicy::kLeafFirst;
    cfg.admission = fdp.ConsumeBool() ? hicache::Admission::kAlways : hicache::Admission::kAdaptive;
    // Waiting for the tier (synchronous fetches on the caller's thread) or prefetching (fetches
    // on the tier thread, served to a later prompt).
    cfg.tier.wait_us = fdp.ConsumeBool() ? 0 : 10'000'000;
    cfg.tier.queue_pages = fdp.ConsumeIntegralInRange<std::int64_t>(1, 16);
    // Rounds of one page up to the whole prefix.
    cfg.tier.buffer_bytes = fdp.ConsumeIntegralInRange<std::int64_t>(1, 16) * 2 * kBytes;
    // A cache that loads layer by layer checks fetched pages as they arrive (on the tier
    // thread); any other, by their first load.
    if (fdp.ConsumeBool()) cfg.layer_segments = {1};
    h.open(tier);
  }
  const char* const salts[2] = {"", "tenant-2"};

  for (int step = 0; step < 64 && fdp.remaining_bytes() > 0; ++step) {
    const int op = fdp.ConsumeIntegralInRange(0, 7);
    Host& host = hosts[fdp.ConsumeIntegralInRange(0, 1)];
    hicache::HostPrefixCache& cache = *host.cache;
    const std::string rid = "r" + std::to_string(fdp.ConsumeIntegralInRange(0, 3));
    const int salt = fdp.ConsumeIntegralInRange(0, 1);
    const std::vector<std::int32_t> prompt = hicache_fuzz::decode_prompt(fdp);
    const std::vector<std::int64_t> ids = hicache_fuzz::rotated_block_table(
        prompt.size(), fdp.ConsumeIntegralInRange<std::int64_t>(0, kBlocks - 1));
    try {
      if (op == 0) {
        const auto n_full = static_cast<std::int64_t>(prompt.size()) / kB;
        for (std::int64_t i = 0; i < n_full && i < static_cast<std::int64_t>(ids.size()); ++i)
          host.blocks[static_cast<std::size_t>(ids[static_cast<std::size_t>(i)])] =
              digest(prompt, static_cast<std::size_t>((i + 1) * kB), salt);  // prefill
        cache.store(rid, prompt, ids, nullptr, {}, salts[salt]);
      } else if (op == 1) {
        hicache::LayerwiseLoad layers;
        const bool layerwise = !cache.config().layer_segments.empty() && fdp.ConsumeBool();
        const std::int64_t got = cache.try_resume(
            rid, prompt,
            [&](std::int64_t tokens) -> std::optional<std::vector<std::int64_t>> {
              return std::vector<std::int64_t>(ids.begin(), ids.begin() + tokens / kB);
            },
            nullptr, std::nullopt, salts[salt], layerwise ? &layers : nullptr);
        if (layerwise) {
          if (layers.tokens() != got) fail("layer-wise tokens");
          layers.synchronize();
        }
        for (std::int64_t i = 0; i < got / kB; ++i) {
          if (host.blocks[static_cast<std::size_t>(ids[static_cast<std::size_t>(i)])] !=
              digest(prompt, static_cast<std::size_t>((i + 1) * kB), salt)) {
            fail("a served page is not the KV of its prefix and salt");
          }
        }
        if (got > 0 && got % kB != 0) fail("a hit that is not a whole number of pages");
        const auto n = static_cast<std::int64_t>(prompt.size());
        if (got > 0 && got > n - cache.config().keep_tokens) fail("keep_tokens cap broken");
      } else if (op == 2) {
        cache.prefetch(prompt, salts[salt]);
      } else if (op == 3) {
        cache.poll();
      } else if (op == 4) {
        cache.forget(rid);
      } else if (op == 5) {
        if (!cache.flush_tier(std::chrono::milliseconds(10'000))) fail("flush_tier timed out");
      } else if (op == 6 && !memory) {
        const auto which = fdp.ConsumeIntegral<std::uint8_t>();
        const auto at = fdp.ConsumeIntegral<std::uint32_t>();
        damage_a_file(dir->path, which, at,
                      static_cast<unsigned char>(fdp.ConsumeIntegralInRange(1, 255)));
      } else if (op == 7 && !memory) {
        // The engines restart: their host memory is gone, the directory's pages are not.
        for (Host& h : hosts) h.cache.reset();
        tier.reset();
        try {
          tier = std::make_shared<hicache::DiskTier>(disk);
        } catch (const hicache::Error&) {
          return 0;  // a damaged format file: the directory is refused, as it should be
        }
        for (Host& h : hosts) h.open(tier);
      } else if (op == 6) {
        // A value damaged in the store: a byte of its page (the value's first kBytes bytes: a
        // flip anywhere would land in the record nine times in ten), any byte, its length, or
        // another value's bytes under its name.
        const std::vector<std::string> names = memory->names();
        if (names.empty()) continue;
        const std::string& name =
            names[fdp.ConsumeIntegralInRange<std::size_t>(0, names.size() - 1)];
        const int how = fdp.ConsumeIntegralInRange(0, 5);
        const auto at = fdp.ConsumeIntegral<std::uint16_t>();
        const auto bits = static_cast<std::byte>(fdp.ConsumeIntegralInRange(1, 255));
        std::vector<std::byte> other;
        if (how == 4) {
          const std::string& from =
              names[fdp.ConsumeIntegralInRange<std::size_t>(0, names.size() - 1)];
          memory->edit(from, [&](std::vector<std::byte>& v) { other = v; });
        }
        if (how == 5) {
          memory->erase(name);
        } else {
          memory->edit(name, [&](std::vector<std::byte>& v) {
            const std::size_t page = std::min<std::size_t>(v.size(), kBytes);
            if (how == 0 && page > 0) v[at % page] ^= bits;
            if (how == 1 && !v.empty()) v[at % v.size()] ^= bits;
            if (how == 2) v.resize(at % (v.size() + 1));
            if (how == 3) v.push_back(bits);
            if (how == 4) v = other;
          });
        }
      } else {
        memory->fail_next(fdp.ConsumeIntegralInRange(1, 3));
      }
    } catch (const hicache::UnknownRequest&) {
    }
    for (const Host& h : hosts) {
      const hicache::CacheStats s = h.cache->stats();
      if (s.pages_used > s.pages_capacity || s.pages_busy > s.pages_used) fail("page accounting");
      if (s.errors != 0) fail("a tier's fault counted as the cache's own error");
      if (s.disabled) fail("a tier's fault disabled the cache");
    }
  }
  for (Host& h : hosts) {
    if (!h.cache->flush_tier(std::chrono::milliseconds(10'000))) fail("flush_tier timed out");
    h.cache->poll();
    const hicache::CacheStats s = h.cache->stats();
    if (s.pages_busy != 0 || s.transfers_in_flight != 0) fail("held after draining");
    if (s.tier_pages_queued != 0) fail("pages still queued for the tier after a flush");
  }
  return 0;
}
