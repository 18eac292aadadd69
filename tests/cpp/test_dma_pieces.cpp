// DmaPieces: a DMA submission's pieces, joined where a page's host slot and engine block both
// continue the piece before (either way round), and only then. Checked on the CPU by applying
// the pieces with memcpy: the bytes must land as page-by-page copies would put them.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <random>
#include <vector>

#include "dma_pieces.hpp"

namespace {

using hicache::cuda::DmaPieces;

constexpr std::size_t kPage = 64;

// Stand-ins for an engine tensor (blocks) and a host pool (slots), filled with distinct bytes.
struct Memory {
  explicit Memory(std::size_t pages) : blocks(pages * kPage), slots(pages * kPage) {
    std::mt19937 rng(3);
    for (auto& b : blocks) b = static_cast<char>(rng());
  }
  char* block(std::size_t i) { return blocks.data() + i * kPage; }
  char* slot(std::size_t i) { return slots.data() + i * kPage; }
  std::vector<char> blocks, slots;
};

struct Move {
  std::size_t block, slot;
};

// The moves as a store's pieces (slot <- block), a full submission handed over as the copier
// does; returns the pieces submitted, after applying them.
std::size_t store(Memory& m, const std::vector<Move>& moves, bool may_join, std::size_t limit) {
  DmaPieces pieces(limit);
  std::size_t submitted = 0;
  auto submit = [&] {
    for (std::size_t i = 0; i < pieces.size(); ++i) {
      std::memcpy(pieces.dst()[i], pieces.src()[i], pieces.sizes()[i]);
    }
    submitted += pieces.size();
    pieces.clear();
  };
  for (const Move& mv : moves) {
    if (!pieces.add(m.slot(mv.slot), m.block(mv.block), kPage, may_join)) {
      EXPECT_EQ(pieces.size(), limit) << "refused before the submission was full";
      submit();
      EXPECT_TRUE(pieces.add(m.slot(mv.slot), m.block(mv.block), kPage, false));
    }
  }
  submit();
  return submitted;
}

void expect_stored(Memory& m, const std::vector<Move>& moves) {
  for (const Move& mv : moves) {
    ASSERT_EQ(std::memcmp(m.slot(mv.slot), m.block(mv.block), kPage), 0)
        << "block " << mv.block << " in slot " << mv.slot;
  }
}

}  // namespace

TEST(DmaPieces, PagesWhoseSlotsAndBlocksRunForwardsJoinIntoOnePiece) {
  Memory m(300);
  std::vector<Move> moves;
  for (std::size_t i = 0; i < 300; ++i) moves.push_back({i, i});
  EXPECT_EQ(store(m, moves, true, 128), 1u);  // and across a full submission's end
  expect_stored(m, moves);
}

TEST(DmaPieces, PagesWhoseSlotsAndBlocksRunBackwardsJoinIntoOnePiece) {
  // A store into the slots an eviction freed, an old chain's leaf first.
  Memory m(40);
  std::vector<Move> moves;
  for (std::size_t i = 0; i < 40; ++i) moves.push_back({39 - i, 39 - i});
  EXPECT_EQ(store(m, moves, true, 128), 1u);
  expect_stored(m, moves);
}

TEST(DmaPieces, PiecesThatTouchOnOneSideOnlyStayApart) {
  // The negative controls: slots in order but blocks every other one; blocks in order but
  // slots backwards; and a run in order with joining not asked for (several segments).
  Memory m(80);
  std::vector<Move> gaps, crossed, in_order;
  for (std::size_t i = 0; i < 40; ++i) {
    gaps.push_back({2 * i, i});
    crossed.push_back({i, 79 - i});
    in_order.push_back({i, i});
  }
  EXPECT_EQ(store(m, gaps, true, 128), 40u);
  expect_stored(m, gaps);
  EXPECT_EQ(store(m, crossed, true, 128), 40u);
  expect_stored(m, crossed);
  EXPECT_EQ(store(m, in_order, false, 16), 40u);  // three full submissions and the rest
  expect_stored(m, in_order);
}

TEST(DmaPieces, RunsEitherWayInAShuffledPoolBecomeAPieceEach) {
  // Runs of 1-20 pages, each forwards or backwards, at slots and blocks apart from every other
  // run's, in random order: a piece a run, and every byte where a page-by-page copy puts it.
  std::mt19937 rng(11);
  std::vector<std::vector<Move>> runs;
  std::size_t pages = 0;
  for (int r = 0; r < 200; ++r) {
    const std::size_t len = 1 + rng() % 20;
    std::vector<Move> run;
    for (std::size_t i = 0; i < len; ++i) run.push_back({pages + i, pages + i});
    if (rng() % 2) std::reverse(run.begin(), run.end());
    runs.push_back(run);
    pages += len + 1;  // a page between runs: no two runs touch
  }
  // Blocks keep each run's own order but the runs go to shuffled places in the engine tensor.
  std::vector<std::size_t> at(runs.size());
  for (std::size_t r = 0; r < at.size(); ++r) at[r] = r;
  std::shuffle(at.begin(), at.end(), rng);
  std::vector<std::size_t> start(runs.size());
  for (std::size_t k = 0, next = 0; k < at.size(); ++k) {
    start[at[k]] = next;
    next += runs[at[k]].size() + 1;
  }
  std::vector<Move> moves;
  for (std::size_t r = 0; r < runs.size(); ++r) {
    const std::size_t lo = std::min_element(runs[r].begin(), runs[r].end(), [](auto& a, auto& b) {
                             return a.block < b.block;
                           })->block;
    for (Move mv : runs[r]) moves.push_back({start[r] + (mv.block - lo), mv.slot});
  }
  Memory m(pages + runs.size());
  EXPECT_EQ(store(m, moves, true, 128), runs.size());
  expect_stored(m, moves);
}
