#include "simulator/contention.h"

#include <algorithm>
#include <utility>

namespace pipeplan {
namespace {

constexpr int kEgress = 1, kIngress = 2;

// Directions of a rank's NIC an op uses (0: none, it stays inside the node).
int Directions(const Table& t, OpId i, const std::vector<bool>& spans_nodes) {
  const OpKind k = t.kind(i);
  if (IsP2P(k)) {
    if (t.ranks()[t.peer(i)].node == t.ranks()[t.rank(i)].node) return 0;
    return IsSend(k) ? kEgress : kIngress;
  }
  if (IsCollective(k)) return spans_nodes[t.peer(i)] ? kEgress | kIngress : 0;
  if (IsCopy(k) && t.peer(i) >= 0 && t.ranks()[t.peer(i)].node != t.ranks()[t.rank(i)].node)
    return k == OpKind::kOffload ? kEgress : kIngress;  // to another stage's memory and back
  return 0;
}

}  // namespace

std::vector<double> ContendedDurations(const Table& t, const Timeline& tl,
                                       const std::vector<double>& base, const CostModel& cost) {
  std::vector<double> out = base;
  if (cost.unit()) return out;
  std::vector<bool> spans_nodes(t.num_groups(), false);
  for (int32_t g = 0; g < t.num_groups(); ++g) {
    auto members = t.group(g);
    for (int32_t r : members)
      if (t.ranks()[r].node != t.ranks()[members[0]].node) spans_nodes[g] = true;
  }
  const double alpha = cost.spec().inter_latency_s;
  struct Span {
    double start, end;
    OpId op;
    int dirs;
  };
  std::vector<Span> spans;
  std::vector<double> shared;  // per span: overlap with others on a shared direction
  std::vector<std::pair<double, size_t>> active;
  for (int32_t r = 0; r < t.num_ranks(); ++r) {
    spans.clear();
    for (OpId i = t.rank_begin(r); i < t.rank_end(r); ++i)
      if (int d = Directions(t, i, spans_nodes); d != 0 && tl.end[i] > tl.start[i])
        spans.push_back({tl.start[i], tl.end[i], i, d});
    if (spans.size() < 2) continue;
    std::sort(spans.begin(), spans.end(), [](const Span& a, const Span& b) {
      return a.start < b.start || (a.start == b.start && a.op < b.op);
    });
    shared.assign(spans.size(), 0.0);
    // Sweep in start order; the active set holds the spans not yet ended, sorted by
    // (end, index) (a few at a time: a sorted vector).
    active.clear();
    size_t first = 0;  // active[first..] are live
    for (size_t k = 0; k < spans.size(); ++k) {
      while (first < active.size() && active[first].first <= spans[k].start) ++first;
      if (first > 64 && first * 2 > active.size())
        active.erase(active.begin(), active.begin() + first), first = 0;
      for (size_t a = first; a < active.size(); ++a) {
        const auto [end, j] = active[a];
        if (!(spans[j].dirs & spans[k].dirs)) continue;
        const double overlap = std::min(end, spans[k].end) - spans[k].start;
        shared[j] += overlap, shared[k] += overlap;
      }
      const std::pair<double, size_t> entry{spans[k].end, k};
      active.insert(std::upper_bound(active.begin() + first, active.end(), entry), entry);
    }
    for (size_t k = 0; k < spans.size(); ++k) {
      if (shared[k] <= 0) continue;
      const OpId i = spans[k].op;
      const double bw_term = std::max(0.0, base[i] - alpha);
      out[i] = base[i] + bw_term * shared[k] / (spans[k].end - spans[k].start);
    }
  }
  return out;
}

}  // namespace pipeplan
