// Admission policies, the ghost of recent keys, and the flat table behind the index.

#include <gtest/gtest.h>

#include <list>
#include <random>
#include <unordered_map>
#include <vector>

#include "flat_lru.hpp"
#include "hicache/admission_policy.hpp"
#include "hicache/entry_table.hpp"
#include "hicache/prefix_index.hpp"
#include "hicache/trace_replay.hpp"

namespace {

std::vector<hicache::Key> prompt(std::uint64_t id, int pages) {
  std::vector<hicache::Key> keys;
  for (int j = 0; j < pages; ++j)
    keys.push_back(hicache::replay_key(id, static_cast<std::uint32_t>(j)));
  return keys;
}

}  // namespace

TEST(GhostKeys, RemembersAKeyForOneToTwoGenerationsOfLaterKeys) {
  hicache::GhostKeys ghost(100);
  ghost.record(7);
  for (std::uint64_t k = 1000; k < 1099; ++k) ghost.record(k);  // 100 keys: the generation fills
  EXPECT_TRUE(ghost.contains(7));                               // now in the older generation
  for (std::uint64_t k = 2000; k < 2099; ++k) ghost.record(k);
  EXPECT_TRUE(ghost.contains(7));
  ghost.record(3000);  // the newer generation fills again: the one holding 7 is dropped
  EXPECT_FALSE(ghost.contains(7));
  EXPECT_TRUE(ghost.contains(2000));
  EXPECT_LE(ghost.size(), 200u);
  ghost.record(0);  // fingerprint 0 is a key like any other
  EXPECT_TRUE(ghost.contains(0));
}

TEST(Admission, SecondSightingDeclinesAFirstSightingOnlyWhileThePoolIsFull) {
  auto policy = hicache::make_admission_policy(hicache::Admission::kSecondSighting, 64);
  const auto a = prompt(1, 4);
  policy->observe(a);
  EXPECT_TRUE(policy->admit(0, /*pool_full=*/false));  // free slots cost nothing
  EXPECT_FALSE(policy->admit(0, /*pool_full=*/true));
  policy->observe(a);  // seen again
  for (std::size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(policy->admit(i, true));
  // Negative control: write-through admits the first sighting.
  auto always = hicache::make_admission_policy(hicache::Admission::kAlways, 64);
  always->observe(prompt(2, 4));
  EXPECT_TRUE(always->admit(0, true));
}

TEST(Admission, AdaptiveChoosesSecondSightingsUnderAScanAndWriteThroughForQuickReuse) {
  const std::int64_t capacity = 512;  // simulated whole (no sampling below 512 slots)
  auto policy = hicache::make_admission_policy(hicache::Admission::kAdaptive, capacity);
  EXPECT_FALSE(policy->wants_second_sighting());  // starts as write-through
  // A hot prompt of 64 pages between one-off prompts of 600 pages: write-through flushes the hot
  // prompt every time, second sightings keep it.
  const auto hot = prompt(1, 64);
  for (std::uint64_t i = 0; i < 40; ++i) {
    policy->observe(hot);
    policy->observe(prompt(1000 + i, 600));
  }
  EXPECT_TRUE(policy->wants_second_sighting());
  EXPECT_FALSE(policy->admit(0, true));  // a one-off's page, first seen, pool full
  // Prompts seen exactly twice, back to back: write-through hits each second sighting, second
  // sighting admission never hits; the choice follows.
  for (std::uint64_t i = 0; i < 400; ++i) {
    const auto p = prompt(5000 + i, 100);
    policy->observe(p);
    policy->observe(p);
  }
  EXPECT_FALSE(policy->wants_second_sighting());
  policy->observe(prompt(9999, 4));
  EXPECT_TRUE(policy->admit(0, true));
}

TEST(Admission, AStoreObservedInInstallmentsIsAdmittedAsIfObservedWhole) {
  // HostPrefixCache::store hashes and admits a long prompt 16, 16, 32... pages at a time. The
  // policy must answer for every page as it would have for the whole prompt at once.
  for (auto kind : {hicache::Admission::kSecondSighting, hicache::Admission::kAdaptive}) {
    SCOPED_TRACE(std::string(hicache::admission_name(kind)));
    const std::int64_t capacity = 512;
    auto whole = hicache::make_admission_policy(kind, capacity);
    auto parts = hicache::make_admission_policy(kind, capacity);
    auto split = hicache::make_admission_policy(kind, capacity);  // the control: two stores
    std::mt19937_64 rng(5);
    std::size_t differ = 0;
    std::size_t admitted_late = 0;  // pages past the first installment admitted in a full pool
    for (int s = 0; s < 300; ++s) {
      // Prompts that share prefixes and come back, some seen once, a scan now and then.
      const auto keys = prompt(rng() % 40, s % 25 == 0 ? 900 : 16 + static_cast<int>(rng() % 90));
      const std::span<const hicache::Key> all(keys);
      whole->observe(all);
      parts->observe(all.first(std::min<std::size_t>(16, all.size())));
      split->observe(all.first(std::min<std::size_t>(16, all.size())));
      for (std::size_t lo = 16; lo < all.size(); lo *= 2) {
        parts->observe_more(all.subspan(lo, std::min(lo, all.size() - lo)));
      }
      if (all.size() > 16) split->observe(all.subspan(16));  // another store, not the same one
      EXPECT_EQ(parts->wants_second_sighting(), whole->wants_second_sighting());
      for (std::size_t i = 0; i < all.size(); ++i) {
        ASSERT_EQ(parts->admit(i, true), whole->admit(i, true)) << "store " << s << " page " << i;
        if (i >= 16 && split->admit(i - 16, true) != whole->admit(i, true)) ++differ;
        if (i >= 16 && whole->admit(i, true)) ++admitted_late;
      }
    }
    // Teeth: later installments' pages are admitted (a policy that lost their sightings would
    // decline them), and for the adaptive policy, observing the rest as a store of its own (a
    // choice made again midway) answers differently.
    EXPECT_GT(admitted_late, 100u);
    if (kind == hicache::Admission::kAdaptive) {
      EXPECT_GT(differ, 0u);
    }
  }
}

TEST(Admission, NamesRoundTripAndABadNameIsNamed) {
  for (auto a : {hicache::Admission::kAlways, hicache::Admission::kSecondSighting,
                 hicache::Admission::kAdaptive}) {
    EXPECT_EQ(hicache::parse_admission(hicache::admission_name(a)), a);
  }
  try {
    hicache::parse_admission("lfu");
    FAIL() << "accepted 'lfu'";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("'lfu'"), std::string::npos);
  }
}

TEST(EntryTable, MatchesAHashMapOverRandomInsertsAndErasesWithCollidingTags) {
  // Keys share their first eight bytes (the tag) in groups of eight, so probe runs are long
  // and backward-shift deletion moves entries across them.
  std::mt19937_64 rng(1);
  std::vector<hicache::Entry> pool(4096);
  for (std::size_t i = 0; i < pool.size(); ++i) {
    const std::uint64_t tag = i / 8, low = i;
    std::memcpy(pool[i].key.bytes.data(), &tag, 8);
    std::memcpy(pool[i].key.bytes.data() + 8, &low, 8);
  }
  hicache::EntryTable<hicache::Entry> table;
  std::unordered_map<std::size_t, bool> present;
  for (int op = 0; op < 200000; ++op) {
    const std::size_t i = rng() % pool.size();
    if (present[i]) {
      table.erase(&pool[i]);
      present[i] = false;
    } else {
      table.insert(&pool[i]);
      present[i] = true;
    }
    const std::size_t probe = rng() % pool.size();
    ASSERT_EQ(table.find(pool[probe].key), present[probe] ? &pool[probe] : nullptr) << "op " << op;
  }
  std::size_t n = 0;
  for (const auto& [i, in] : present) {
    n += in ? 1 : 0;
    ASSERT_EQ(table.find(pool[i].key), in ? &pool[i] : nullptr);
  }
  EXPECT_EQ(table.size(), n);
}

TEST(FlatLru, AgreesWithAListAndAMapOverRandomAccesses) {
  // The reference is what the adaptive policy's simulated pools were: a std::list, most
  // recently used first, and a map from each fingerprint to its node. Small universes make
  // every path run: hits, adds below and at capacity, and drops from the back.
  for (const std::size_t capacity : {1u, 2u, 7u, 64u, 300u}) {
    std::mt19937_64 rng(capacity);
    hicache::detail::FlatLru lru(capacity);
    std::list<std::uint64_t> order;
    std::unordered_map<std::uint64_t, std::list<std::uint64_t>::iterator> where;
    const std::uint64_t universe = 3 * capacity + 2;
    for (int step = 0; step < 20000; ++step) {
      // Fingerprints of few bits and spread ones alike (their homes collide or not).
      const std::uint64_t k = rng() % universe;
      const std::uint64_t fp = step % 2 ? k : k * 0x9e3779b97f4a7c15ULL;
      const bool hit = where.count(fp) != 0;
      ASSERT_EQ(lru.touch(fp), hit) << capacity << " step " << step;
      if (hit) {
        order.splice(order.begin(), order, where[fp]);
        continue;
      }
      if (where.size() == capacity) {
        where.erase(order.back());
        order.pop_back();
      }
      order.push_front(fp);
      where[fp] = order.begin();
      lru.add(fp);
      ASSERT_EQ(lru.size(), where.size());
      if (step % 97 == 0) {
        ASSERT_EQ(lru.order(), std::vector<std::uint64_t>(order.begin(), order.end())) << step;
      }
    }
    EXPECT_EQ(lru.order(), std::vector<std::uint64_t>(order.begin(), order.end()));
    EXPECT_TRUE(lru.full());
  }
}
