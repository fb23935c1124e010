#include "planner/validate.h"

#include <fmt/format.h>

#include <boost/graph/adjacency_list.hpp>
#include <boost/graph/depth_first_search.hpp>
#include <map>
#include <unordered_map>

#include "simulator/engine.h"

namespace pipeplan {
namespace {

using Graph = boost::adjacency_list<boost::vecS, boost::vecS, boost::directedS>;

struct CycleFound {
  OpId from, to;
};

struct BackEdgeVisitor : boost::default_dfs_visitor {
  template <typename Edge, typename G>
  void back_edge(Edge e, const G& g) const {
    throw CycleFound{static_cast<OpId>(boost::source(e, g)),
                     static_cast<OpId>(boost::target(e, g))};
  }
};

Status CheckAcyclic(const Table& t) {
  // Edge u -> v: u must end before v starts.
  Graph g(t.size());
  for (int32_t r = 0; r < t.num_ranks(); ++r) {
    OpId last[2] = {UINT32_MAX, UINT32_MAX};
    for (OpId i = t.rank_begin(r); i < t.rank_end(r); ++i) {
      int s = static_cast<int>(StreamOf(t.kind(i)));
      if (last[s] != UINT32_MAX) boost::add_edge(last[s], i, g);
      last[s] = i;
    }
  }
  for (OpId i = 0; i < t.size(); ++i)
    for (OpId d : t.deps(i)) {
      if (d >= t.size())
        return InvalidPlan(fmt::format("{}: depends on op {} which does not exist", t.str(i), d));
      boost::add_edge(d, i, g);
    }
  try {
    boost::depth_first_search(g, boost::visitor(BackEdgeVisitor()));
  } catch (const CycleFound& c) {
    return InvalidPlan(fmt::format("{}: dependency cycle through {}", t.str(c.to), t.str(c.from)));
  }
  return Status::Ok();
}

Status CheckPairs(const Table& t) {
  std::vector<uint8_t> matched(t.size(), 0);
  for (OpId i = 0; i < t.size(); ++i) {
    if (!IsRecv(t.kind(i))) continue;
    auto d = t.deps(i);
    const OpKind want = t.kind(i) == OpKind::kRecvF ? OpKind::kSendF : OpKind::kSendB;
    OpId s = UINT32_MAX;
    for (OpId x : d)
      if (IsSend(t.kind(x))) {
        if (s != UINT32_MAX) return InvalidPlan(fmt::format("{}: depends on two SENDs", t.str(i)));
        s = x;
      }
    if (s == UINT32_MAX) return InvalidPlan(fmt::format("{}: no matching SEND", t.str(i)));
    if (t.kind(s) != want || t.rank(s) != t.peer(i) || t.peer(s) != t.rank(i) ||
        t.tag(s) != t.tag(i) || t.mb(s) != t.mb(i) || t.module(s) != t.module(i) ||
        t.work(s).payload_bytes != t.work(i).payload_bytes)
      return InvalidPlan(fmt::format(
          "{}: does not match {} (kind, peer, tag, micro-batch or payload)", t.str(i), t.str(s)));
    if (matched[s]++) return InvalidPlan(fmt::format("{}: received twice", t.str(s)));
  }
  for (OpId i = 0; i < t.size(); ++i)
    if (IsSend(t.kind(i)) && !matched[i])
      return InvalidPlan(fmt::format("{}: no matching RECV", t.str(i)));

  std::map<std::pair<int32_t, uint32_t>, std::vector<OpId>> instances;
  for (OpId i = 0; i < t.size(); ++i)
    if (IsCollective(t.kind(i))) instances[{t.peer(i), t.tag(i)}].push_back(i);
  for (auto& [key, ops] : instances) {
    auto group = t.group(key.first);
    std::vector<int32_t> ranks;
    for (OpId i : ops) {
      ranks.push_back(t.rank(i));
      if (t.kind(i) != t.kind(ops[0]) || t.work(i).payload_bytes != t.work(ops[0]).payload_bytes)
        return InvalidPlan(
            fmt::format("{}: differs from {} in the same collective", t.str(i), t.str(ops[0])));
    }
    std::sort(ranks.begin(), ranks.end());
    std::vector<int32_t> want(group.begin(), group.end());
    std::sort(want.begin(), want.end());
    if (ranks != want)
      return InvalidPlan(
          fmt::format("{}: {} ops for a group of {} ranks (each member exactly once)",
                      t.str(ops[0]), ops.size(), want.size()));
  }
  return Status::Ok();
}

// Text data flow: F(g, m) after its input, B(g, m) after F(g, m) and its gradient input.
Status CheckFlow(const Table& t) {
  const PlanMeta& m = t.meta();
  const int pp = m.pp, vp = m.vp, M = m.microbatches, S = pp * vp;
  if (t.num_ranks() != m.dp * pp)
    return InvalidPlan(
        fmt::format("plan has {} ranks, expected dp*pp = {}", t.num_ranks(), m.dp * pp));
  // Dense index (rank, chunk, mb) -> op for F, B, RECV_F, RECV_B of text.
  const size_t slots = static_cast<size_t>(t.num_ranks()) * vp * M;
  std::vector<OpId> idx[4];
  for (auto& v : idx) v.assign(slots, UINT32_MAX);
  auto slot = [&](int32_t r, int32_t c, int32_t mb) {
    return (static_cast<size_t>(r) * vp + c) * M + mb;
  };
  for (OpId i = 0; i < t.size(); ++i) {
    if (t.module(i) != Module::kText) continue;
    int which;
    switch (t.kind(i)) {
      case OpKind::kF:
        which = 0;
        break;
      case OpKind::kB:
        which = 1;
        break;
      case OpKind::kRecvF:
        which = 2;
        break;
      case OpKind::kRecvB:
        which = 3;
        break;
      default:
        continue;
    }
    if (t.chunk(i) < 0 || t.chunk(i) >= vp || t.mb(i) < 0 || t.mb(i) >= M)
      return InvalidPlan(fmt::format(
          "{}: chunk or micro-batch out of range (vp = {}, micro-batches = {})", t.str(i), vp, M));
    OpId& s = idx[which][slot(t.rank(i), t.chunk(i), t.mb(i))];
    if (s != UINT32_MAX) return InvalidPlan(fmt::format("{}: appears twice", t.str(i)));
    s = i;
  }
  auto name = [&](int kind, int32_t r, int32_t c, int32_t mb) {
    return FormatOp(OpKey{r, kind == 0 ? OpKind::kF : OpKind::kB, Module::kText, c, mb});
  };
  // Producer `prod` (on rank pr) must reach consumer `cons` on rank r: locally earlier, or
  // through a RECV on r (before cons) whose SEND comes after prod.
  auto arrives = [&](OpId prod, OpId cons, int recv_kind) -> Status {
    if (t.rank(prod) == t.rank(cons)) {
      if (prod < cons) return Status::Ok();
      return InvalidPlan(fmt::format("{}: runs before its input {}", t.str(cons), t.str(prod)));
    }
    OpId recv = idx[recv_kind][slot(t.rank(cons), t.chunk(cons), t.mb(cons))];
    if (recv == UINT32_MAX)
      return InvalidPlan(fmt::format("{}: its input {} is on r{} and never received", t.str(cons),
                                     t.str(prod), t.rank(prod)));
    if (recv > cons)
      return InvalidPlan(
          fmt::format("{}: runs before {} delivers its input", t.str(cons), t.str(recv)));
    OpId send = t.deps(recv).empty() ? UINT32_MAX : t.deps(recv)[0];
    if (send == UINT32_MAX || t.rank(send) != t.rank(prod) || t.chunk(send) != t.chunk(prod))
      return InvalidPlan(fmt::format("{}: receives from the wrong producer (expected output of {})",
                                     t.str(recv), t.str(prod)));
    if (send < prod)
      return InvalidPlan(fmt::format("{}: sends before {} produced it", t.str(send), t.str(prod)));
    return Status::Ok();
  };
  for (int d = 0; d < m.dp; ++d) {
    for (int mb = 0; mb < M; ++mb) {
      for (int g = 0; g < S; ++g) {
        const int32_t r = d * pp + g % pp, c = g / pp;
        OpId f = idx[0][slot(r, c, mb)], b = idx[1][slot(r, c, mb)];
        if (f == UINT32_MAX)
          return InvalidPlan(
              fmt::format("micro-batch {} of replica {} skips {}", mb, d, name(0, r, c, mb)));
        if (b == UINT32_MAX)
          return InvalidPlan(
              fmt::format("micro-batch {} of replica {} skips {}", mb, d, name(1, r, c, mb)));
        if (b < f) return InvalidPlan(fmt::format("{}: runs before {}", t.str(b), t.str(f)));
        if (g > 0) {
          const int32_t pr = d * pp + (g - 1) % pp, pc = (g - 1) / pp;
          RETURN_IF_ERROR(arrives(idx[0][slot(pr, pc, mb)], f, 2));
        }
        if (g < S - 1) {
          const int32_t nr = d * pp + (g + 1) % pp, nc = (g + 1) / pp;
          RETURN_IF_ERROR(arrives(idx[1][slot(nr, nc, mb)], b, 3));
        }
      }
    }
  }
  return Status::Ok();
}

}  // namespace

Status ValidatePlan(const Table& t) {
  RETURN_IF_ERROR(CheckAcyclic(t));
  RETURN_IF_ERROR(CheckPairs(t));
  RETURN_IF_ERROR(CheckFlow(t));
  auto progress = Simulate(t, std::vector<double>(t.size(), 0.0));
  if (!progress.ok()) return progress.status();
  return Status::Ok();
}

}  // namespace pipeplan
