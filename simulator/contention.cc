#include "simulator/contention.h"

#include <fmt/format.h>

#include <algorithm>
#include <utility>

#include "core/parallel.h"

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

LinkContention::LinkContention(const Table& t, const CostModel& cost)
    : unit_(cost.unit()), size_(t.size()) {
  if (unit_) return;
  alpha_ = cost.spec().inter_latency_s;
  std::vector<bool> spans_nodes(t.num_groups(), false);
  for (int32_t g = 0; g < t.num_groups(); ++g) {
    auto members = t.group(g);
    for (int32_t r : members)
      if (t.ranks()[r].node != t.ranks()[members[0]].node) spans_nodes[g] = true;
  }
  // Counted first: the arrays are sized to the transfers (a large share of a table's ops).
  size_t count = 0;
  for (OpId i = 0; i < t.size(); ++i) count += Directions(t, i, spans_nodes) != 0;
  ops_.reserve(count), dirs_.reserve(count);
  begin_.assign(t.num_ranks() + 1, 0);
  for (int32_t r = 0; r < t.num_ranks(); ++r) {
    for (OpId i = t.rank_begin(r); i < t.rank_end(r); ++i)
      if (const int d = Directions(t, i, spans_nodes); d != 0) {
        ops_.push_back(i);
        dirs_.push_back(static_cast<uint8_t>(d));
      }
    begin_[r + 1] = ops_.size();
  }
}

Status LinkContention::KeepBase(const std::vector<double>& base) {
  if (base.size() != size_)
    return Internal(fmt::format("link contention: {} base durations for a table of {} ops",
                                base.size(), size_));
  base_.resize(ops_.size());
  for (size_t k = 0; k < ops_.size(); ++k) base_[k] = base[ops_[k]];
  kept_ = true;
  return Status::Ok();
}

StatusOr<bool> LinkContention::Update(const Timeline& tl, std::vector<double>* durations) const {
  if (!kept_) return Internal("link contention: durations updated before the base was kept");
  if (durations->size() != size_ || tl.start.size() != size_ || tl.end.size() != size_)
    return Internal(
        fmt::format("link contention: {} durations and a timeline of {} ops for a table of {}",
                    durations->size(), tl.start.size(), size_));
  if (unit_) return false;
  // Ranks are independent (each writes its own ops): large tables are swept in parts of
  // about equal transfer counts, on the machine's cores.
  constexpr size_t kParts = 8;
  const size_t parts = ops_.size() >= kParallelFromOps ? kParts : 1;
  std::vector<size_t> first_rank(parts + 1, begin_.size() - 1);
  for (size_t p = 0; p < parts; ++p)
    first_rank[p] = std::lower_bound(begin_.begin(), begin_.end() - 1, p * ops_.size() / parts) -
                    begin_.begin();
  std::vector<char> changed(parts, 0);
  RunParallel(parts, [&](size_t p) {
    changed[p] = Sweep(first_rank[p], first_rank[p + 1], tl, durations);
  });
  return std::find(changed.begin(), changed.end(), 1) != changed.end();
}

bool LinkContention::Sweep(size_t from, size_t to, const Timeline& tl,
                           std::vector<double>* out) const {
  struct Span {
    double start, end;
    uint32_t k;  // the transfer
    int dirs;
  };
  bool changed = false;
  auto set = [&](size_t k, double d) {
    if ((*out)[ops_[k]] != d) (*out)[ops_[k]] = d, changed = true;
  };
  std::vector<Span> spans;
  std::vector<double> shared;  // per span: overlap with others on a shared direction
  std::vector<std::pair<double, size_t>> active;
  for (size_t r = from; r < to; ++r) {
    spans.clear();
    for (size_t k = begin_[r]; k < begin_[r + 1]; ++k)
      if (const OpId i = ops_[k]; tl.end[i] > tl.start[i])
        spans.push_back({tl.start[i], tl.end[i], static_cast<uint32_t>(k), dirs_[k]});
      else
        set(k, base_[k]);  // takes no time: shares nothing
    // In start order (transfers are in op order within the rank).
    std::sort(spans.begin(), spans.end(), [](const Span& a, const Span& b) {
      return a.start < b.start || (a.start == b.start && a.k < b.k);
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
      const double base = base_[spans[k].k];
      const double bw_term = std::max(0.0, base - alpha_);
      set(spans[k].k,
          shared[k] <= 0 ? base : base + bw_term * shared[k] / (spans[k].end - spans[k].start));
    }
  }
  return changed;
}

StatusOr<std::vector<double>> ContendedDurations(const Table& t, const Timeline& tl,
                                                 const std::vector<double>& base,
                                                 const CostModel& cost) {
  LinkContention links(t, cost);
  RETURN_IF_ERROR(links.KeepBase(base));
  std::vector<double> out = base;
  RETURN_IF_ERROR(links.Update(tl, &out).status());
  return out;
}

}  // namespace pipeplan
