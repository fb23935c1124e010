// The list scheduler's queue of ranks waiting to decide (planner/list_schedule.cc).
#pragma once

#include <bit>
#include <cstdint>
#include <limits>
#include <utility>
#include <vector>

namespace pipeplan {

// Ranks by the time of their next decision, earliest first (ties: the lowest rank), as a
// tournament tree over ranks: a change walks one leaf-to-root path, without the
// mispredicted branches of a binary heap's sift-down. A rank holds `count` decisions at
// its time; a push at a later time replaces them (they are stale: a rank's time only
// grows), so a rank pops as often as a heap of (time, rank) would pop it with a time still
// current. A pop's removal waits for the next call: the popped rank usually pushes again
// at once, and one walk does for both.
class DecisionQueue {
 public:
  static constexpr double kEmpty = std::numeric_limits<double>::infinity();
  void Reset(int ranks) {
    leaves_ = 1;
    while (leaves_ < ranks) leaves_ *= 2;
    node_.assign(2 * static_cast<size_t>(leaves_), Node{Key(kEmpty), 0});
    for (int r = 0; r < leaves_; ++r) node_[leaves_ + r].rank = r;
    count_.assign(leaves_, 0);
    popped_ = -1;
  }
  bool Empty() {
    Settle();
    return node_[1].key == Key(kEmpty);
  }
  // `t` >= 0 (not NaN).
  void Push(int r, double t) {
    Node& leaf = node_[leaves_ + r];
    const uint64_t key = Key(t);
    if (count_[r] > 0 && leaf.key == key) {
      ++count_[r];
      return;
    }
    if (popped_ != r) Settle();
    popped_ = -1;
    leaf.key = key;
    count_[r] = 1;
    Update(r);
  }
  // The earliest rank and its time; call only when not Empty().
  std::pair<double, int> Pop() {
    Settle();
    const Node top = node_[1];
    if (--count_[top.rank] == 0) {
      node_[leaves_ + top.rank].key = Key(kEmpty);
      popped_ = top.rank;
    }
    return {std::bit_cast<double>(top.key), top.rank};
  }

 private:
  // A time's bits: non-negative doubles (+inf included) order as their bit patterns do,
  // so the walk compares integers and selects without branches (a branch on the keys
  // mispredicts about half the time). +0.0 stands for -0.0.
  static uint64_t Key(double t) { return std::bit_cast<uint64_t>(t + 0.0); }
  struct Node {
    uint64_t key;
    int rank;
  };
  void Settle() {
    if (popped_ >= 0) Update(popped_);
    popped_ = -1;
  }
  // The walk always reaches the root (stopping where the winner is unchanged would be
  // a branch on the keys again).
  void Update(int r) {
    size_t i = static_cast<size_t>(leaves_) + r;
    uint64_t key = node_[i].key;
    uint64_t rank = static_cast<uint32_t>(node_[i].rank);
    for (; i > 1; i /= 2) {
      const Node& sib = node_[i ^ 1];
      const uint64_t sk = sib.key, sr = static_cast<uint32_t>(sib.rank);
      const uint64_t take = (sk < key) | ((sk == key) & (sr < rank));
      const uint64_t mask = 0 - take;
      key = (sk & mask) | (key & ~mask);
      rank = (sr & mask) | (rank & ~mask);
      node_[i / 2] = Node{key, static_cast<int>(rank)};
    }
  }
  int leaves_ = 1;
  std::vector<Node> node_;  // node_[1] the root; leaves at [leaves_, 2 leaves_)
  std::vector<int> count_;
  int popped_ = -1;  // a rank popped to empty whose path is not updated yet
};

}  // namespace pipeplan
