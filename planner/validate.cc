#include "planner/validate.h"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <bit>
#include <boost/graph/adjacency_list.hpp>
#include <boost/graph/depth_first_search.hpp>
#include <map>
#include <tuple>

#include "planner/lower.h"
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

// The back edge a depth-first search meets first: the cycle named in the error (only run
// once the cycle is known to exist).
Status NameCycle(const Table& t) {
  // Edge u -> v: u must end before v starts.
  Graph g(t.size());
  for (int32_t r = 0; r < t.num_ranks(); ++r) {
    std::array<OpId, kNumStreams> last;
    last.fill(UINT32_MAX);
    for (OpId i = t.rank_begin(r); i < t.rank_end(r); ++i) {
      int s = static_cast<int>(StreamOf(t.kind(i)));
      if (last[s] != UINT32_MAX) boost::add_edge(last[s], i, g);
      last[s] = i;
    }
  }
  for (OpId i = 0; i < t.size(); ++i)
    for (OpId d : t.deps(i)) boost::add_edge(d, i, g);
  try {
    boost::depth_first_search(g, boost::visitor(BackEdgeVisitor()));
  } catch (const CycleFound& c) {
    return InvalidPlan(fmt::format("{}: dependency cycle through {}", t.str(c.to), t.str(c.from)));
  }
  return Internal("a dependency cycle was found but no back edge");
}

// The ops and their constraints (each op after the previous op of its stream and after
// its dependencies) form a graph without cycles: proven by a topological order, built
// over the table's own arrays. Each rank's streams are walked in order; a stream stops
// at an op whose dependency has not been ordered yet, and is woken when that dependency's
// rank next moves. Every op is ordered exactly when no cycle exists.
Status CheckAcyclic(const Table& t) {
  const size_t n = t.size();
  for (OpId i = 0; i < n; ++i)
    for (OpId d : t.deps(i)) {
      if (d >= n)
        return InvalidPlan(fmt::format("{}: depends on op {} which does not exist", t.str(i), d));
      // A rank's sequence is an order its ops can run in, whatever their streams (an
      // executor's streams wait for earlier ops only).
      if (d >= i && t.rank(d) == t.rank(i))
        return InvalidPlan(
            fmt::format("{}: depends on {}, which comes after it on its rank", t.str(i), t.str(d)));
    }
  const int32_t R = t.num_ranks();
  std::vector<uint8_t> ordered(n, 0);
  std::vector<std::array<OpId, kNumStreams>> cursor(R);
  std::vector<std::vector<std::pair<int32_t, OpId>>> waiters(R);  // (rank, op awaited)
  std::vector<int32_t> queue;
  std::vector<uint8_t> queued(R, 1);
  for (int32_t r = 0; r < R; ++r) {
    cursor[r].fill(t.rank_begin(r));
    queue.push_back(r);
  }
  size_t count = 0;
  while (!queue.empty()) {
    const int32_t r = queue.back();
    queue.pop_back();
    queued[r] = 0;
    for (size_t before = count + 1; before != count;) {  // until neither stream moves
      before = count;
      for (int s = 0; s < kNumStreams; ++s) {
        OpId& i = cursor[r][s];
        for (; i < t.rank_end(r); ++i) {
          if (static_cast<int>(StreamOf(t.kind(i))) != s) continue;
          OpId missing = UINT32_MAX;
          for (OpId d : t.deps(i))
            if (!ordered[d]) {
              missing = d;
              break;
            }
          if (missing != UINT32_MAX) {
            if (t.rank(missing) != r) waiters[t.rank(missing)].push_back({r, missing});
            break;
          }
          ordered[i] = 1;
          ++count;
        }
      }
    }
    auto& w = waiters[r];
    for (size_t k = 0; k < w.size();) {
      if (ordered[w[k].second]) {
        if (!queued[w[k].first]) queued[w[k].first] = 1, queue.push_back(w[k].first);
        w[k] = w.back();
        w.pop_back();
      } else {
        ++k;
      }
    }
  }
  return count == n ? Status::Ok() : NameCycle(t);
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

  // Collective instances by (group, tag), in that order; members in op order.
  std::vector<std::tuple<int32_t, uint32_t, OpId>> grouped;
  for (OpId i = 0; i < t.size(); ++i)
    if (t.grouped(i)) grouped.emplace_back(t.peer(i), t.tag(i), i);
  std::sort(grouped.begin(), grouped.end());
  std::vector<OpId> ops;
  for (size_t a = 0, b = 0; a < grouped.size(); a = b) {
    ops.clear();
    for (b = a; b < grouped.size() && std::get<0>(grouped[b]) == std::get<0>(grouped[a]) &&
                std::get<1>(grouped[b]) == std::get<1>(grouped[a]);
         ++b)
      ops.push_back(std::get<2>(grouped[b]));
    auto group = t.group(std::get<0>(grouped[a]));
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

// Text data flow: F(g, m) after its input, B(g, m) after F(g, m) and its gradient input; a
// split backward: I(g, m) in B's place, then W(g, m) on the same rank over the same layers.
Status CheckFlow(const Table& t) {
  const PlanMeta& m = t.meta();
  const int pp = m.pp, vp = m.vp, M = m.microbatches, S = pp * vp;
  if (t.num_ranks() != m.dp * pp)
    return InvalidPlan(
        fmt::format("plan has {} ranks, expected dp*pp = {}", t.num_ranks(), m.dp * pp));
  if (m.placement == StagePlacement::kV && vp % 2 != 0)
    return InvalidPlan(fmt::format("V placement needs an even vp, got {}", vp));
  // Dense index (rank, chunk, mb) -> op. Slots: 0 F, 1 the backward producing the input
  // gradient (B or I; a B split into bucket pieces: its first piece, which takes the
  // gradient), 2 RECV_F, 3 RECV_B, 4 the last piece of that backward (which produces the
  // gradient for the stage before), 5 W (its first piece), 6 the last piece of W.
  const size_t slots = static_cast<size_t>(t.num_ranks()) * vp * M;
  std::vector<OpId> idx[7];
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
      case OpKind::kI:
        which = 1;
        break;
      case OpKind::kRecvF:
        which = 2;
        break;
      case OpKind::kRecvB:
        which = 3;
        break;
      case OpKind::kW:
        which = 5;
        break;
      default:
        continue;
    }
    if (t.chunk(i) < 0 || t.chunk(i) >= vp || t.mb(i) < 0 || t.mb(i) >= M)
      return InvalidPlan(fmt::format(
          "{}: chunk or micro-batch out of range (vp = {}, micro-batches = {})", t.str(i), vp, M));
    const size_t at = slot(t.rank(i), t.chunk(i), t.mb(i));
    const Work& w = t.work(i);
    if (which != 2 && which != 3 && (w.layer_begin < 0 || w.layer_end < w.layer_begin))
      return InvalidPlan(fmt::format("{}: its work has no layer range", t.str(i)));
    const int last_slot = which == 5 ? 6 : 4;
    if ((which == 1 || which == 5) && t.piece(i) > 0) {  // pieces in order, layers adjacent
      OpId prev = idx[last_slot][at];
      if (prev == UINT32_MAX || t.piece(prev) != t.piece(i) - 1 || t.kind(prev) != t.kind(i))
        return InvalidPlan(fmt::format("{}: runs before the piece of its later layers", t.str(i)));
      if (t.work(prev).layer_begin != w.layer_end)
        return InvalidPlan(
            fmt::format("{}: its layers do not end where {} begins", t.str(i), t.str(prev)));
      idx[last_slot][at] = i;
      continue;
    }
    OpId& s = idx[which][at];
    if (s != UINT32_MAX) return InvalidPlan(fmt::format("{}: appears twice", t.str(i)));
    s = i;
    if (which == 1 || which == 5) idx[last_slot][at] = i;
  }
  auto name = [&](OpKind kind, int32_t r, int32_t c, int32_t mb) {
    return FormatOp(OpKey{r, kind, Module::kText, c, mb});
  };
  // Producer `prod` (on rank pr) must reach consumer `cons` on rank r: locally earlier, or
  // through a RECV on r (before cons) whose SEND comes after prod.
  auto arrives = [&](OpId prod, OpId cons, int recv_kind) -> Status {
    if (prod == UINT32_MAX)
      return InvalidPlan(fmt::format("{}: the op producing its input does not exist", t.str(cons)));
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
    OpId send = t.send_of(recv);
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
        const StageHome h = m.home(g);
        const int32_t r = d * pp + h.pp_rank, c = h.chunk;
        OpId f = idx[0][slot(r, c, mb)], b = idx[1][slot(r, c, mb)];
        if (f == UINT32_MAX)
          return InvalidPlan(fmt::format("micro-batch {} of replica {} skips {}", mb, d,
                                         name(OpKind::kF, r, c, mb)));
        if (b == UINT32_MAX)
          return InvalidPlan(fmt::format("micro-batch {} of replica {} skips {}", mb, d,
                                         name(OpKind::kB, r, c, mb)));
        if (b < f) return InvalidPlan(fmt::format("{}: runs before {}", t.str(b), t.str(f)));
        // The backward covers the forward's layers (whole, or its pieces end to end).
        const OpId last = idx[4][slot(r, c, mb)];
        if (t.work(b).layer_end != t.work(f).layer_end ||
            t.work(last).layer_begin != t.work(f).layer_begin)
          return InvalidPlan(
              fmt::format("{}: does not cover the layers of {}", t.str(b), t.str(f)));
        const OpId w = idx[5][slot(r, c, mb)];
        if (t.kind(b) == OpKind::kI) {
          if (w == UINT32_MAX)
            return InvalidPlan(fmt::format("{}: its weight gradient {} never runs", t.str(b),
                                           name(OpKind::kW, r, c, mb)));
          if (w < b) return InvalidPlan(fmt::format("{}: runs before {}", t.str(w), t.str(b)));
          if (t.work(w).layer_end != t.work(f).layer_end ||
              t.work(idx[6][slot(r, c, mb)]).layer_begin != t.work(f).layer_begin)
            return InvalidPlan(
                fmt::format("{}: does not cover the layers of {}", t.str(w), t.str(f)));
        } else if (w != UINT32_MAX) {
          return InvalidPlan(
              fmt::format("{}: a weight gradient for {}, a full backward", t.str(w), t.str(b)));
        }
        if (g > 0) {
          const StageHome p = m.home(g - 1);
          RETURN_IF_ERROR(arrives(idx[0][slot(d * pp + p.pp_rank, p.chunk, mb)], f, 2));
        }
        if (g < S - 1) {
          const StageHome n = m.home(g + 1);
          RETURN_IF_ERROR(arrives(idx[4][slot(d * pp + n.pp_rank, n.chunk, mb)], b, 3));
        }
      }
    }
  }
  return Status::Ok();
}

// Vision and generator data flow (architecture.md, Dependencies):
//   vision F(t of m) reaches text F(chunk 0, m) on the replica's first stage;
//   vision B(t) runs after vision F(t) and after text B(chunk 0, m) produced its gradient;
//   text F(last, m) -> generator F(m) -> generator B(m) -> text B(last, m).
Status CheckModality(const Table& t) {
  const PlanMeta& m = t.meta();
  // Ops by (rank, module, kind, chunk, mb, task, piece): an open-addressing table of op
  // ids (the key is read from the table's columns).
  using Key = std::tuple<int32_t, int, int, int32_t, int32_t, int32_t, int32_t>;
  auto key_of = [&](OpId i) {
    return Key{t.rank(i),
               static_cast<int>(t.module(i)),
               static_cast<int>(t.kind(i)),
               t.chunk(i),
               t.mb(i),
               t.task(i),
               t.piece(i)};
  };
  auto hash = [](const Key& k) {
    uint64_t h = 0x9e3779b97f4a7c15ull;
    auto mix = [&](uint64_t v) { h = (h ^ v) * 0xff51afd7ed558ccdull, h ^= h >> 32; };
    std::apply([&](auto... v) { (mix(static_cast<uint32_t>(v)), ...); }, k);
    return h;
  };
  std::vector<OpId> at(std::bit_ceil(std::max<size_t>(16, t.size() * 2)), UINT32_MAX);
  const size_t mask = at.size() - 1;
  // The slot holding `k`, or the empty slot where it would go.
  auto slot_of = [&](const Key& k) {
    size_t s = hash(k) & mask;
    while (at[s] != UINT32_MAX && key_of(at[s]) != k) s = (s + 1) & mask;
    return s;
  };
  std::vector<OpId> modal;
  for (OpId i = 0; i < t.size(); ++i) {
    const Module mod = t.module(i);
    const OpKind k = t.kind(i);
    if (mod == Module::kOptimizer || IsCollective(k)) continue;
    if (mod == Module::kText &&
        !(k == OpKind::kF || k == OpKind::kB || k == OpKind::kI || k == OpKind::kSendB))
      continue;
    OpId& slot = at[slot_of(key_of(i))];
    if (slot != UINT32_MAX) return InvalidPlan(fmt::format("{}: appears twice", t.str(i)));
    slot = i;
    if (mod != Module::kText && (k == OpKind::kF || k == OpKind::kB)) modal.push_back(i);
  }
  auto find = [&](int32_t rank, Module mod, OpKind k, int32_t chunk, int32_t mb, int32_t task,
                  int32_t piece = -1) {
    return at[slot_of(
        Key{rank, static_cast<int>(mod), static_cast<int>(k), chunk, mb, task, piece})];
  };
  // A text op; a backward split into bucket pieces: its first piece (which takes the
  // gradient) or, with `last_piece`, its last (which produces the input gradient).
  auto text = [&](int32_t rank, OpKind k, int32_t chunk, int32_t mb, bool last_piece = false) {
    OpId i = find(rank, Module::kText, k, chunk, mb, -1);
    if (i != UINT32_MAX || k != OpKind::kB) return i;
    i = find(rank, Module::kText, OpKind::kI, chunk, mb, -1);  // a split backward
    if (i != UINT32_MAX) return i;
    i = find(rank, Module::kText, k, chunk, mb, -1, 0);
    for (int32_t p = 1; last_piece && i != UINT32_MAX; ++p) {
      OpId next = find(rank, Module::kText, k, chunk, mb, -1, p);
      if (next == UINT32_MAX) break;
      i = next;
    }
    return i;
  };
  // `prod` must reach `cons`: earlier on the same rank, or through a RECV of the
  // consumer's module/micro-batch/task on the consumer's rank whose SEND follows `prod`.
  auto arrives = [&](OpId prod, OpId cons, Module recv_mod, OpKind recv_kind, int32_t chunk,
                     int32_t task, const char* what) -> Status {
    if (prod == UINT32_MAX)
      return InvalidPlan(fmt::format("{}: {} does not exist", t.str(cons), what));
    if (t.rank(prod) == t.rank(cons)) {
      if (prod < cons) return Status::Ok();
      return InvalidPlan(fmt::format("{}: runs before {} {}", t.str(cons), what, t.str(prod)));
    }
    OpId recv = find(t.rank(cons), recv_mod, recv_kind, chunk, t.mb(cons), task);
    if (recv == UINT32_MAX || recv > cons)
      return InvalidPlan(
          fmt::format("{}: runs before {} {} arrives", t.str(cons), what, t.str(prod)));
    OpId send = t.send_of(recv);
    if (send == UINT32_MAX || t.rank(send) != t.rank(prod) || send < prod)
      return InvalidPlan(
          fmt::format("{}: sent before {} {} produced it", t.str(recv), what, t.str(prod)));
    return Status::Ok();
  };
  for (OpId i : modal) {
    const int32_t d = t.ranks()[t.rank(i)].dp, mb = t.mb(i), task = t.task(i);
    const StageHome end = m.home(m.pp * m.vp - 1);
    const int32_t last = d * m.pp + end.pp_rank;
    if (t.module(i) == Module::kVision && t.piece(i) >= 0) {
      // Layer-group pieces on one rank: forwards in piece order, backwards in reverse,
      // each backward after its own forward; the last piece carries the task's data flow.
      const int32_t p = t.piece(i), r = t.rank(i), c = t.chunk(i);
      const OpId next = find(r, Module::kVision, t.kind(i), c, mb, task, p + 1);
      if (next != UINT32_MAX) {
        const bool fwd = t.kind(i) == OpKind::kF;
        if ((next < i) == fwd)
          return InvalidPlan(
              fmt::format("{}: runs {} {}", t.str(i), fwd ? "after" : "before", t.str(next)));
        if (!fwd) {
          OpId own = find(r, Module::kVision, OpKind::kF, c, mb, task, p);
          if (own == UINT32_MAX || own > i)
            return InvalidPlan(fmt::format("{}: runs before its forward piece", t.str(i)));
        }
        continue;
      }
    }
    if (t.module(i) == Module::kVision) {
      // The consumer: the peer of the task's SEND_F (or RECV_B), else the rank itself,
      // which must then be a first stage.
      const bool fwd = t.kind(i) == OpKind::kF;
      OpId route = find(t.rank(i), Module::kVision, fwd ? OpKind::kSendF : OpKind::kRecvB,
                        t.chunk(i), mb, task);
      const int32_t consumer = route == UINT32_MAX ? t.rank(i) : t.peer(route);
      if (t.ranks()[consumer].pp != 0)
        return InvalidPlan(
            fmt::format("{}: its visual tokens never reach a first pipeline stage", t.str(i)));
      if (fwd) {
        OpId text_f = text(consumer, OpKind::kF, 0, mb);
        if (text_f == UINT32_MAX)
          return InvalidPlan(fmt::format("{}: micro-batch {} has no text forward", t.str(i), mb));
        RETURN_IF_ERROR(arrives(i, text_f, Module::kVision, OpKind::kRecvF, t.chunk(i), task,
                                "its vision input"));
      } else {
        OpId fwd_op =
            find(t.rank(i), Module::kVision, OpKind::kF, t.chunk(i), mb, task, t.piece(i));
        if (fwd_op == UINT32_MAX || fwd_op > i)
          return InvalidPlan(
              fmt::format("{}: runs before its vision forward on the same rank", t.str(i)));
        RETURN_IF_ERROR(arrives(text(consumer, OpKind::kB, 0, mb, true), i, Module::kVision,
                                OpKind::kRecvB, t.chunk(i), task, "the gradient from"));
      }
    } else if (t.kind(i) == OpKind::kF) {
      // A generator split over the replica's ranks: shard = chunk, its input and gradient
      // travel as generator SEND/RECV of that chunk.
      const int32_t shard = t.chunk(i);
      RETURN_IF_ERROR(arrives(text(last, OpKind::kF, end.chunk, mb), i, Module::kGenerator,
                              OpKind::kRecvF, shard, -1, "its input from"));
      OpId back = find(t.rank(i), Module::kGenerator, OpKind::kB, shard, mb, -1);
      if (back == UINT32_MAX || back < i)
        return InvalidPlan(fmt::format("{}: has no generator backward after it", t.str(i)));
      OpId text_b = text(last, OpKind::kB, end.chunk, mb);
      if (text_b == UINT32_MAX)
        return InvalidPlan(fmt::format("{}: micro-batch {} has no text backward", t.str(i), mb));
      RETURN_IF_ERROR(arrives(back, text_b, shard >= 0 ? Module::kGenerator : Module::kText,
                              OpKind::kRecvB, shard, -1, "the generator gradient"));
    }
  }
  for (OpId i : modal)
    if (t.kind(i) == OpKind::kF && find(t.rank(i), t.module(i), OpKind::kB, t.chunk(i), t.mb(i),
                                        t.task(i), t.piece(i)) == UINT32_MAX)
      return InvalidPlan(fmt::format("{}: has no backward on its rank", t.str(i)));
  return Status::Ok();
}

}  // namespace

// Host copies: each OFFLOAD follows its forward (a dependency: an F of the same module,
// chunk, micro-batch, task and, for modalities, piece, on its rank) and moves what it saved
// out (mem_delta = -payload); one RELOAD brings the same bytes back (depending on the
// OFFLOAD); the first op that reads them (RECOMPUTE, B or I) depends on that RELOAD.
Status CheckHostCopies(const Table& t) {
  auto key_of = [&](OpId i) { return CopyKeyOf(t.key(i)); };
  auto dep_of = [&](OpId i, OpKind kind) {
    for (OpId d : t.deps(i))
      if (t.kind(d) == kind && t.rank(d) == t.rank(i) && key_of(d) == key_of(i)) return d;
    return UINT32_MAX;
  };
  for (int32_t r = 0; r < t.num_ranks(); ++r) {
    std::map<CopyKey, std::pair<OpId, OpId>> out;  // key -> (OFFLOAD, RELOAD or UINT32_MAX)
    std::vector<OpId> grads_back;                  // gradient shards' RELOADs not yet waited for
    std::map<int32_t, OpId> grads_out;             // per chunk: its last gradient shard's OFFLOAD
    for (OpId i = t.rank_begin(r); i < t.rank_end(r); ++i) {
      const OpKind k = t.kind(i);
      const Work& w = t.work(i);
      if (IsCopy(k) && t.module(i) == Module::kOptimizer) {  // pipeline ZeRO-2 gradients
        auto deps = t.deps(i);
        const bool after_reduce = std::any_of(deps.begin(), deps.end(), [&](OpId d) {
          return t.kind(d) == OpKind::kReduceScatter && t.chunk(d) == t.chunk(i) &&
                 t.mb(d) == t.mb(i);
        });
        if (k == OpKind::kOffload && !after_reduce)
          return InvalidPlan(
              fmt::format("{}: copies a gradient shard before its reduction", t.str(i)));
        if (k == OpKind::kOffload) grads_out[t.chunk(i)] = i;
        if (k == OpKind::kReload) {
          auto it = grads_out.find(t.chunk(i));
          if (it != grads_out.end() &&
              std::find(deps.begin(), deps.end(), it->second) == deps.end())
            return InvalidPlan(
                fmt::format("{}: does not wait for {}", t.str(i), t.str(it->second)));
          grads_back.push_back(i);
        }
        continue;
      }
      if (k == OpKind::kOptStep)
        for (OpId g : grads_back)
          if (std::find(t.deps(i).begin(), t.deps(i).end(), g) == t.deps(i).end())
            return InvalidPlan(fmt::format("{}: does not wait for {}", t.str(i), t.str(g)));
      if (k == OpKind::kOffload) {
        if (dep_of(i, OpKind::kF) == UINT32_MAX)
          return InvalidPlan(
              fmt::format("{}: does not follow a forward of its activations", t.str(i)));
        if (!(w.payload_bytes > 0) || w.mem_delta_bytes != -w.payload_bytes)
          return InvalidPlan(fmt::format("{}: must free the bytes it copies", t.str(i)));
        if (!out.emplace(key_of(i), std::pair{i, UINT32_MAX}).second)
          return InvalidPlan(fmt::format("{}: offloads activations already on the host", t.str(i)));
      } else if (k == OpKind::kReload) {
        auto it = out.find(key_of(i));
        if (it == out.end() || it->second.second != UINT32_MAX ||
            dep_of(i, OpKind::kOffload) != it->second.first)
          return InvalidPlan(
              fmt::format("{}: does not follow the OFFLOAD of its activations", t.str(i)));
        if (t.peer(i) != t.peer(it->second.first))
          return InvalidPlan(fmt::format("{}: reloads from elsewhere than {} put them", t.str(i),
                                         t.str(it->second.first)));
        if (w.payload_bytes != t.work(it->second.first).payload_bytes ||
            w.mem_delta_bytes != w.payload_bytes)
          return InvalidPlan(fmt::format("{}: does not bring back what {} moved out", t.str(i),
                                         t.str(it->second.first)));
        it->second.second = i;
      } else if (ReadsSaved(k)) {
        auto it = out.find(key_of(i));
        if (it == out.end()) continue;
        auto [offload, reload] = it->second;
        if (reload == UINT32_MAX)
          return InvalidPlan(fmt::format("{}: reads activations that {} moved to host memory",
                                         t.str(i), t.str(offload)));
        if (std::find(t.deps(i).begin(), t.deps(i).end(), reload) == t.deps(i).end())
          return InvalidPlan(fmt::format("{}: does not wait for {}", t.str(i), t.str(reload)));
        out.erase(it);
      }
    }
    if (!out.empty())
      return InvalidPlan(
          fmt::format("{}: its activations are never read back", t.str(out.begin()->second.first)));
  }
  return Status::Ok();
}

Status ValidatePlan(const Table& t) {
  RETURN_IF_ERROR(CheckAcyclic(t));
  RETURN_IF_ERROR(CheckPairs(t));
  RETURN_IF_ERROR(CheckFlow(t));
  RETURN_IF_ERROR(CheckModality(t));
  RETURN_IF_ERROR(CheckHostCopies(t));
  auto progress = Simulate(t, std::vector<double>(t.size(), 0.0));
  if (!progress.ok()) return progress.status();
  return Status::Ok();
}

}  // namespace pipeplan
