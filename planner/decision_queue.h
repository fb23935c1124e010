// The list scheduler's queue of ranks waiting to decide (planner/list_schedule.cc).
#pragma once

#include <limits>
#include <utility>
#include <vector>

namespace pipeplan {

// Ranks by the time of their next decision, earliest first (ties: the lowest rank), as a
// tournament tree over ranks: a change walks one leaf-to-root path (stopping where the
// winner is unchanged), without the mispredicted branches of a binary heap's sift-down. A
// rank holds `count` decisions at its time; a push at a later time replaces them (they are
// stale: a rank's time only grows), so a rank pops as often as a heap of (time, rank)
// would pop it with a time still current. A pop's removal waits for the next call: the
// popped rank usually pushes again at once, and one walk does for both.
class DecisionQueue {
 public:
  static constexpr double kEmpty = std::numeric_limits<double>::infinity();
  void Reset(int ranks) {
    leaves_ = 1;
    while (leaves_ < ranks) leaves_ *= 2;
    node_.assign(2 * static_cast<size_t>(leaves_), Node{kEmpty, 0});
    for (int r = 0; r < leaves_; ++r) node_[leaves_ + r].rank = r;
    count_.assign(leaves_, 0);
    popped_ = -1;
  }
  bool Empty() {
    Settle();
    return node_[1].key == kEmpty;
  }
  void Push(int r, double t) {
    Node& leaf = node_[leaves_ + r];
    if (count_[r] > 0 && leaf.key == t) {
      ++count_[r];
      return;
    }
    if (popped_ != r) Settle();
    popped_ = -1;
    leaf.key = t;
    count_[r] = 1;
    Update(r);
  }
  // The earliest rank and its time; call only when not Empty().
  std::pair<double, int> Pop() {
    Settle();
    const Node top = node_[1];
    if (--count_[top.rank] == 0) {
      node_[leaves_ + top.rank].key = kEmpty;
      popped_ = top.rank;
    }
    return {top.key, top.rank};
  }

 private:
  struct Node {
    double key;
    int rank;
  };
  void Settle() {
    if (popped_ >= 0) Update(popped_);
    popped_ = -1;
  }
  void Update(int r) {
    size_t i = static_cast<size_t>(leaves_) + r;
    Node cur = node_[i];
    for (; i > 1; i /= 2) {
      const Node& sib = node_[i ^ 1];
      if (sib.key < cur.key || (sib.key == cur.key && sib.rank < cur.rank)) cur = sib;
      Node& parent = node_[i / 2];
      if (parent.rank == cur.rank && parent.key == cur.key) return;  // ancestors unchanged
      parent = cur;
    }
  }
  int leaves_ = 1;
  std::vector<Node> node_;  // node_[1] the root; leaves at [leaves_, 2 leaves_)
  std::vector<int> count_;
  int popped_ = -1;  // a rank popped to empty whose path is not updated yet
};

}  // namespace pipeplan
