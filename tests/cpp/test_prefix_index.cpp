#include <gtest/gtest.h>

#include <map>
#include <random>
#include <unordered_set>
#include <vector>

#include "hicache/child_counts.hpp"
#include "hicache/prefix_index.hpp"
#include "page_fingerprint.hpp"

namespace {

hicache::Key key(int i) {
  hicache::Key k;
  k.bytes[0] = static_cast<std::uint8_t>(i);
  k.bytes[1] = static_cast<std::uint8_t>(i >> 8);
  return k;
}

hicache::Entry* add_ready(hicache::PrefixIndex& idx, int i) {
  hicache::Entry* e = idx.insert(key(i), static_cast<std::uint64_t>(i + 1), 0);
  if (e) {
    idx.unpin(e);
    e->ready = true;
  }
  return e;
}

}  // namespace

TEST(PrefixIndex, EvictsLeastRecentlyUsedIdleEntryAndReusesItsSlot) {
  hicache::PrefixIndex idx(3);
  for (int i = 0; i < 3; ++i) ASSERT_NE(add_ready(idx, i), nullptr);
  idx.touch(idx.find(key(0)));  // order now 1, 2, 0
  const std::int64_t slot1 = idx.find(key(1))->slot;
  hicache::Entry* e = add_ready(idx, 3);
  ASSERT_NE(e, nullptr);
  EXPECT_EQ(idx.find(key(1)), nullptr);
  EXPECT_EQ(e->slot, slot1);
  EXPECT_EQ(idx.evictions(), 1);
  EXPECT_EQ(idx.size(), 3);
}

TEST(PrefixIndex, NeverEvictsAnEntryHeldByATransfer) {
  hicache::PrefixIndex idx(2);
  hicache::Entry* a = add_ready(idx, 0);
  hicache::Entry* b = add_ready(idx, 1);
  idx.pin(a);
  idx.pin(b);
  EXPECT_EQ(idx.busy(), 2);
  EXPECT_EQ(idx.insert(key(2), 9, 0), nullptr);  // everything held: nothing changes
  EXPECT_EQ(idx.size(), 2);
  idx.unpin(b);
  ASSERT_NE(idx.insert(key(2), 9, 0), nullptr);  // b was the only idle one
  EXPECT_EQ(idx.find(key(1)), nullptr);
  EXPECT_NE(idx.find(key(0)), nullptr);
}

TEST(PrefixIndex, PendingEntriesAreHeldUntilUnpinned) {
  hicache::PrefixIndex idx(1);
  hicache::Entry* e = idx.insert(key(0), 1, 0);
  ASSERT_NE(e, nullptr);
  EXPECT_FALSE(e->ready);
  EXPECT_EQ(e->refs, 1);
  EXPECT_EQ(idx.insert(key(1), 2, 0), nullptr);
  EXPECT_THROW(idx.erase(e), std::logic_error);
  idx.unpin(e);
  EXPECT_THROW(idx.unpin(e), std::logic_error);
  idx.erase(e);
  EXPECT_EQ(idx.size(), 0);
}

TEST(PrefixIndex, LruOrderListsLeastRecentFirst) {
  hicache::PrefixIndex idx(4);
  for (int i = 0; i < 4; ++i) add_ready(idx, i);
  idx.touch(idx.find(key(1)));
  idx.touch(idx.find(key(0)));
  std::vector<int> order;
  for (const hicache::Entry* e : idx.lru_order()) order.push_back(e->key.bytes[0]);
  EXPECT_EQ(order, (std::vector<int>{2, 3, 1, 0}));
}

TEST(PrefixIndex, LeafFirstSkipsEntriesWithCachedChildren) {
  hicache::PrefixIndex idx(3, hicache::EvictionPolicy::kLeafFirst);
  hicache::Entry* root = idx.insert(key(0), 10, 1);
  hicache::Entry* child = idx.insert(key(1), 11, 10);  // child of root
  hicache::Entry* other = idx.insert(key(2), 12, 1);
  for (hicache::Entry* e : {root, child, other}) idx.unpin(e);
  // LRU order root, child, other: root has a child, so the child goes first.
  ASSERT_NE(idx.insert(key(3), 13, 1), nullptr);
  EXPECT_EQ(idx.find(key(1)), nullptr);
  EXPECT_NE(idx.find(key(0)), nullptr);
  idx.unpin(idx.find(key(3)));
  // Now root is childless and least recent.
  ASSERT_NE(idx.insert(key(4), 14, 1), nullptr);
  EXPECT_EQ(idx.find(key(0)), nullptr);
}

TEST(PrefixIndex, ContentEdgesFindAnEntryByParentAndFingerprintUntilItGoes) {
  hicache::PrefixIndex idx(2, hicache::EvictionPolicy::kLru);
  hicache::Entry* a = idx.insert(key(1), 10, 5);
  idx.add_edge(a, 777);
  EXPECT_EQ(idx.find_edge(5, 777), a);
  EXPECT_EQ(idx.find_edge(5, 778), nullptr);  // another content
  EXPECT_EQ(idx.find_edge(6, 777), nullptr);  // the same content under another parent
  // A second entry with the same edge is found by its key only: the first keeps the edge.
  hicache::Entry* b = idx.insert(key(2), 11, 5);
  idx.add_edge(b, 777);
  EXPECT_EQ(idx.find_edge(5, 777), a);
  EXPECT_EQ(b->edge, 0u);
  // An erased entry's edge goes with it (a reused Entry must not answer for the old content).
  idx.unpin(a);
  idx.erase(a);
  EXPECT_EQ(idx.find_edge(5, 777), nullptr);
  idx.add_edge(b, 777);  // now it can take it
  EXPECT_EQ(idx.find_edge(5, 777), b);
  // So does an evicted entry's.
  idx.unpin(b);
  b->ready = true;
  hicache::Entry* c = idx.insert(key(3), 12, 5);
  ASSERT_NE(c, nullptr);
  hicache::Entry* d = idx.insert(key(4), 13, 5);  // full: evicts b, the only idle entry
  ASSERT_NE(d, nullptr);
  EXPECT_EQ(idx.find(key(2)), nullptr);
  EXPECT_EQ(idx.find_edge(5, 777), nullptr);
}

TEST(ChildCounts, MatchesAMapOverRandomAddsAndRemoves) {
  // Parents drawn from a few hundred serials with several children each, so probe runs form,
  // wrap around the table's end and are shifted back on removal, while the table grows.
  std::mt19937_64 rng(7);
  hicache::ChildCounts counts;
  std::map<std::uint64_t, int> model;
  for (int op = 0; op < 300000; ++op) {
    const std::uint64_t parent = rng() % 600 + (op / 100000) * 1000;  // new serials over time
    if (rng() % 2 == 0) {
      counts.add(parent);
      ++model[parent];
    } else {
      counts.remove(parent);  // a parent without children stays absent
      auto it = model.find(parent);
      if (it != model.end() && --it->second == 0) model.erase(it);
    }
    const std::uint64_t probe = rng() % 3000;
    ASSERT_EQ(counts.contains(probe), model.count(probe) != 0) << "op " << op;
  }
  for (std::uint64_t p = 0; p < 3000; ++p) ASSERT_EQ(counts.contains(p), model.count(p) != 0);
  EXPECT_EQ(counts.size(), model.size());
  // Removing every child empties it.
  for (auto& [parent, n] : model) {
    for (; n > 0; --n) counts.remove(parent);
  }
  EXPECT_EQ(counts.size(), 0u);
  for (std::uint64_t p = 0; p < 3000; ++p) ASSERT_FALSE(counts.contains(p));
}

TEST(ChildCounts, ConsecutiveParentsMakeNoLongRuns) {
  // Serials are handed out in order, so a cache's live parents are mostly consecutive: here a
  // window of 5000 (a chain each, as conversations leave a pool), sliding as new pages arrive,
  // and an interior parent removed for each one added, as LRU eviction does. A run of occupied
  // slots is what a removal shifts back and a miss probes; placed by their low bits, consecutive
  // serials made one run as long as the window, and every removal scanned it.
  std::mt19937_64 rng(11);
  hicache::ChildCounts counts;
  std::vector<std::uint64_t> live;
  for (std::uint64_t serial = 1; serial <= 200000; ++serial) {
    counts.add(serial);
    live.push_back(serial);
    if (live.size() > 5000) {
      const std::size_t victim = rng() % live.size();
      counts.remove(live[victim]);
      live[victim] = live.back();
      live.pop_back();
    }
  }
  EXPECT_EQ(counts.size(), live.size());
  for (std::uint64_t s : live) ASSERT_TRUE(counts.contains(s));
  EXPECT_LT(counts.longest_run(), 32u) << "with " << counts.size() << " parents";
}

// Pages found by content are filed under a fingerprint of their tokens: different pages should
// get different fingerprints (a shared one is safe, since callers compare tokens, but makes the
// second page a keyed lookup). Prompts' pages (runs of consecutive token ids), pages one token
// apart at every position, every length up to 40 tokens, and every single flipped bit of a
// 128-token page.
TEST(PageFingerprint, DifferentPagesGetDifferentFingerprints) {
  using hicache::detail::page_fingerprint;
  std::unordered_set<std::uint64_t> seen;
  std::size_t pages = 0;
  auto add = [&](const std::vector<std::int32_t>& page) {
    ++pages;
    return seen.insert(page_fingerprint(page)).second;
  };
  std::vector<std::int32_t> page(16);
  for (std::int32_t start = 0; start < 100000; ++start) {  // sliding windows over a prompt
    for (std::size_t t = 0; t < 16; ++t) page[t] = start + static_cast<std::int32_t>(t);
    ASSERT_TRUE(add(page)) << "window " << start;
  }
  std::vector<std::int32_t> base(128, 7);
  for (std::size_t pos = 0; pos < base.size(); ++pos) {  // one token changed, anywhere
    for (std::int32_t v : {0, 8, -1, 1 << 30}) {
      auto changed = base;
      changed[pos] = v;
      ASSERT_TRUE(add(changed)) << "token " << pos << " = " << v;
    }
  }
  for (std::size_t len = 0; len <= 40; ++len) {  // every length, the same tokens otherwise
    ASSERT_TRUE(add(std::vector<std::int32_t>(len, 3))) << len << " tokens";
  }
  const std::uint64_t whole = page_fingerprint(base);
  for (std::size_t bit = 0; bit < base.size() * 32; ++bit) {
    auto flipped = base;
    flipped[bit / 32] ^= static_cast<std::int32_t>(1u << (bit % 32));
    ASSERT_NE(page_fingerprint(flipped), whole) << "bit " << bit;
  }
  EXPECT_EQ(seen.size(), pages);
}
