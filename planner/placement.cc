#include "planner/placement.h"

#include <fmt/format.h>

#include <algorithm>
#include <map>
#include <numeric>

namespace pipeplan {
namespace {

constexpr uint32_t kModalityTagBase = 0x80000000u;

int FirstStage(const PipelineShape& s, int d) { return s.rank(d, 0); }
int LastStage(const PipelineShape& s, int d) { return s.rank(d, s.pp - 1); }

Anchor Before(OpKind k, int chunk, int mb) { return {k, chunk, mb, false}; }
Anchor After(OpKind k, int chunk, int mb) { return {k, chunk, mb, true}; }
Anchor End() { return {OpKind::kF, 0, -1, false}; }

// Longest-processing-time assignment of tasks to the ranks of their replica, starting
// from `base` seconds per rank (e.g. each rank's text compute); a task weighs its forward
// and backward (3x forward). Returns the rank per task (-1 for tasks not in `which`).
std::vector<int> BalanceOverReplica(const PipelineShape& s, const std::vector<VisionTask>& tasks,
                                    const std::vector<size_t>& which, std::vector<double> base) {
  std::vector<int> rank(tasks.size(), -1);
  std::vector<size_t> order = which;
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return tasks[a].seconds > tasks[b].seconds; });
  base.resize(static_cast<size_t>(s.dp) * s.pp, 0.0);
  for (size_t i : order) {
    int best = s.rank(tasks[i].d, 0);
    for (int st = 1; st < s.pp; ++st)
      if (base[s.rank(tasks[i].d, st)] < base[best]) best = s.rank(tasks[i].d, st);
    base[best] += 3 * tasks[i].seconds;
    rank[i] = best;
  }
  return rank;
}

// Compute seconds of each rank in a timeline (text-only plans: the text load).
std::vector<double> BusySeconds(const Table& t, const Timeline& tl) {
  std::vector<double> busy(t.num_ranks(), 0.0);
  for (OpId i = 0; i < t.size(); ++i)
    if (IsCompute(t.kind(i))) busy[t.rank(i)] += tl.end[i] - tl.start[i];
  return busy;
}

// Nested anchors for a task of micro-batch m on the rank of stage j. In the 1F1B steady
// state every stage runs its k-th backward at about the same moment, so anchoring on
// backward indices makes all stages take their share of a micro-batch's encoder work in
// the same round (their stalls overlap instead of adding up):
//   forward:  before the stage's text backward (chunk 0) of micro-batch m - pp - 1, i.e.
//             a round before the consumer's text forward of m; up front for the first ones;
//   backward: before the stage's text backward of m + 1 + j, by when the first stage has
//             produced the gradient (right after it, on the first stage itself).
// Each stage keeps about (pp + 2 + j) / pp encoder units alive: O(1) in micro-batches.
VisionPlacement NestedAnchors(const PipelineShape& s, const VisionTask& t, int rank) {
  const int j = rank % s.pp, kf = t.mb - s.pp - 1, kb = t.mb + 1 + j;
  VisionPlacement p;
  p.rank = rank;
  p.f = kf < 0 ? Before(OpKind::kF, 0, 0) : Before(OpKind::kB, 0, kf);
  p.b = j == 0 ? After(OpKind::kB, 0, t.mb) : kb < s.m ? Before(OpKind::kB, 0, kb) : End();
  return p;
}

}  // namespace

std::vector<VisionPlacement> PlaceVisionInline(const PipelineShape& s, const ModalityWork& w) {
  std::vector<VisionPlacement> out;
  for (const VisionTask& t : w.vision)
    out.push_back({FirstStage(s, t.d), Before(OpKind::kF, 0, t.mb), After(OpKind::kB, 0, t.mb), false});
  return out;
}

std::vector<VisionPlacement> PlaceVisionDecoupled(const PipelineShape& s, const ModalityWork& w, bool recompute) {
  std::vector<size_t> all(w.vision.size());
  std::iota(all.begin(), all.end(), 0);
  std::vector<int> rank = BalanceOverReplica(s, w.vision, all, {});
  std::vector<VisionPlacement> out;
  for (size_t i = 0; i < w.vision.size(); ++i) {
    // All forwards before the rank's first text op, all backwards after its last one.
    out.push_back({rank[i], Before(OpKind::kF, 0, 0), End(), recompute});
  }
  return out;
}

std::vector<VisionPlacement> PlaceVisionNested(const PipelineShape& s, const ModalityWork& w, const Table& text,
                                               const Timeline& tl) {
  // The tasks of each micro-batch go to distinct stages, the largest to the stage with the
  // least text + vision compute so far, anchored by NestedAnchors.
  std::vector<double> load = BusySeconds(text, tl);
  std::vector<VisionPlacement> out(w.vision.size());
  for (size_t b = 0; b < w.vision.size();) {
    size_t e = b;
    while (e < w.vision.size() && w.vision[e].d == w.vision[b].d && w.vision[e].mb == w.vision[b].mb) ++e;
    std::vector<size_t> tasks(e - b);
    std::iota(tasks.begin(), tasks.end(), b);
    std::stable_sort(tasks.begin(), tasks.end(), [&](size_t x, size_t y) { return w.vision[x].seconds > w.vision[y].seconds; });
    std::vector<int> stages(s.pp);
    std::iota(stages.begin(), stages.end(), 0);
    std::stable_sort(stages.begin(), stages.end(),
                     [&](int x, int y) { return load[s.rank(w.vision[b].d, x)] < load[s.rank(w.vision[b].d, y)]; });
    for (size_t k = 0; k < tasks.size(); ++k) {
      const VisionTask& t = w.vision[tasks[k]];
      int rank = s.rank(t.d, stages[k % s.pp]);
      load[rank] += 3 * t.seconds;
      out[tasks[k]] = NestedAnchors(s, t, rank);
    }
    b = e;
  }
  return out;
}

std::vector<VisionPlacement> PlaceVisionBubbleFill(const PipelineShape& s, const ModalityWork& w, const Table& text,
                                                   const Timeline& tl) {
  // Idle gaps per rank before each text compute op: [end of previous compute op, start).
  struct Gap {
    int rank;
    Anchor before;  // insert before this text op
    double start, len;
  };
  std::vector<Gap> gaps;
  std::map<std::tuple<int, int, int, int>, std::pair<double, double>> when;  // (rank, kind, chunk, mb) -> start, end
  for (int32_t r = 0; r < text.num_ranks(); ++r) {
    double prev_end = 0;
    for (OpId i = text.rank_begin(r); i < text.rank_end(r); ++i) {
      OpKind k = text.kind(i);
      if (text.module(i) != Module::kText || (k != OpKind::kF && k != OpKind::kB)) continue;
      when[{r, static_cast<int>(k), text.chunk(i), text.mb(i)}] = {tl.start[i], tl.end[i]};
      if (tl.start[i] > prev_end) gaps.push_back({r, Before(k, text.chunk(i), text.mb(i)), prev_end, tl.start[i] - prev_end});
      prev_end = tl.end[i];
    }
  }
  // Start from the nested placement; the forwards of the first pp micro-batches stay up
  // front there.
  std::vector<VisionPlacement> out = PlaceVisionNested(s, w, text, tl);
  std::vector<size_t> all(w.vision.size());
  std::iota(all.begin(), all.end(), 0);
  // Remaining forwards, earliest deadline first, into the earliest gap (of any rank of the
  // replica) that ends before the consumer's text forward starts.
  std::vector<size_t> rest;
  for (size_t i = 0; i < w.vision.size(); ++i)
    if (w.vision[i].mb >= s.pp) rest.push_back(i);
  auto deadline = [&](size_t i) { return when[{FirstStage(s, w.vision[i].d), 0, 0, w.vision[i].mb}].first; };
  std::stable_sort(rest.begin(), rest.end(), [&](size_t a, size_t b) { return deadline(a) < deadline(b); });
  for (size_t i : rest) {
    const VisionTask& t = w.vision[i];
    Gap* best = nullptr;
    for (Gap& g : gaps)
      if (text.ranks()[g.rank].dp == t.d && g.len >= t.seconds && g.start + t.seconds <= deadline(i) &&
          (!best || g.start < best->start))
        best = &g;
    if (!best) continue;
    out[i] = NestedAnchors(s, t, best->rank);
    out[i].f = best->before;
    best->start += t.seconds, best->len -= t.seconds;
  }
  // Backwards, in order of their gradients (text B of chunk 0 ended), into a gap on the
  // task's rank (its activations live there) after the gradient exists; else the nested
  // anchor (the last group's backwards form the epilogue).
  std::vector<size_t> order = all;
  auto release = [&](size_t i) { return when[{FirstStage(s, w.vision[i].d), 1, 0, w.vision[i].mb}].second; };
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return release(a) < release(b); });
  for (size_t i : order) {
    const VisionTask& t = w.vision[i];
    const double dur = t.seconds * t.b.flops / std::max(t.f.flops, 1.0);
    Gap* best = nullptr;
    for (Gap& g : gaps)
      if (g.rank == out[i].rank && g.len >= dur && g.start >= release(i) && (!best || g.start < best->start)) best = &g;
    if (!best) continue;
    out[i].b = best->before;
    best->start += dur, best->len -= dur;
  }
  return out;
}

std::vector<GeneratorPlacement> PlaceGenerator(const PipelineShape& s, const ModalityWork& w, bool decoupled) {
  std::vector<GeneratorPlacement> out;
  const int last = s.vp - 1;
  for (const GeneratorTask& t : w.generator) {
    GeneratorPlacement p;
    p.rank = LastStage(s, t.d);
    p.f = After(OpKind::kF, last, t.mb);
    // Decoupled: every generator backward waits for all forwards (a phase), so the
    // generator activations of every micro-batch are alive at once.
    p.b = decoupled ? Before(OpKind::kB, last, 0) : After(OpKind::kF, last, t.mb);
    out.push_back(p);
  }
  return out;
}

Status InsertModality(std::vector<RankSeq>* seqs, const PipelineShape& s, const ModalityWork& w,
                      const ModalityWorkIds& ids, const std::vector<VisionPlacement>& vision,
                      const std::vector<GeneratorPlacement>& generator) {
  // Position of every text compute op per rank.
  std::vector<std::map<std::tuple<int, int, int>, size_t>> pos(seqs->size());
  for (size_t r = 0; r < seqs->size(); ++r)
    for (size_t i = 0; i < (*seqs)[r].size(); ++i) {
      const OpKey& k = (*seqs)[r][i].key;
      pos[r][{static_cast<int>(k.kind), k.chunk, k.mb}] = i;
    }
  // Insertions: (position, slot, sequence number) -> op. Slots order ops at one position:
  // 0 gradient sends after a text backward, 1 modality compute (and their RECV_B / SEND_F
  // in order), 2 RECV_F right before the text forward that consumes them.
  struct Ins {
    size_t pos;
    int slot;
    size_t seq;
    PendingOp op;
  };
  std::vector<std::vector<Ins>> ins(seqs->size());
  size_t counter = 0;
  Status error;
  auto at = [&](int rank, const Anchor& a) -> size_t {
    if (a.mb < 0) return (*seqs)[rank].size();
    auto it = pos[rank].find({static_cast<int>(a.kind), a.chunk, a.mb});
    if (it == pos[rank].end()) {
      error = Internal(fmt::format("no anchor {} c{} m{} on rank {}", KindName(a.kind), a.chunk, a.mb, rank));
      return 0;
    }
    return it->second + (a.after ? 1 : 0);
  };
  auto add = [&](int rank, size_t p, int slot, OpKey key, WorkId work, uint32_t tag = 0) {
    key.rank = rank;
    ins[rank].push_back({p, slot, counter++, {key, work, tag}});
  };
  for (size_t i = 0; i < w.vision.size(); ++i) {
    const VisionTask& t = w.vision[i];
    const VisionPlacement& p = vision[i];
    const int c = FirstStage(s, t.d);
    const uint32_t tag = kModalityTagBase + static_cast<uint32_t>(i) * 4;
    OpKey base{0, OpKind::kF, Module::kVision, -1, t.mb, t.task, -1};
    OpKey k = base;
    size_t fpos = at(p.rank, p.f), bpos = at(p.rank, p.b);
    add(p.rank, fpos, 1, k, ids.vision_f[i]);
    if (p.rank != c) {
      k.kind = OpKind::kSendF, k.peer = c;
      add(p.rank, fpos, 1, k, ids.vision_out[i], tag);
      k.kind = OpKind::kRecvF, k.peer = p.rank;
      add(c, at(c, Before(OpKind::kF, 0, t.mb)), 2, k, ids.vision_out[i], tag);
      k.kind = OpKind::kSendB, k.peer = p.rank;
      add(c, at(c, After(OpKind::kB, 0, t.mb)), 0, k, ids.vision_out[i], tag + 1);
      k.kind = OpKind::kRecvB, k.peer = c;
      add(p.rank, bpos, 1, k, ids.vision_out[i], tag + 1);
    }
    if (p.recompute) {
      k = base, k.kind = OpKind::kRecompute;
      add(p.rank, bpos, 1, k, ids.vision_recompute[i]);
    }
    k = base, k.kind = OpKind::kB;
    add(p.rank, bpos, 1, k, ids.vision_b[i]);
  }
  for (size_t i = 0; i < w.generator.size(); ++i) {
    const GeneratorPlacement& p = generator[i];
    OpKey k{0, OpKind::kF, Module::kGenerator, -1, w.generator[i].mb, -1, -1};
    add(p.rank, at(p.rank, p.f), 1, k, ids.generator_f[i]);
    k.kind = OpKind::kB;
    add(p.rank, at(p.rank, p.b), 1, k, ids.generator_b[i]);
  }
  if (!error.ok()) return error;
  for (size_t r = 0; r < seqs->size(); ++r) {
    if (ins[r].empty()) continue;
    std::stable_sort(ins[r].begin(), ins[r].end(), [](const Ins& a, const Ins& b) {
      return std::tie(a.pos, a.slot, a.seq) < std::tie(b.pos, b.slot, b.seq);
    });
    RankSeq out;
    out.reserve((*seqs)[r].size() + ins[r].size());
    size_t j = 0;
    for (size_t i = 0; i <= (*seqs)[r].size(); ++i) {
      for (; j < ins[r].size() && ins[r][j].pos == i; ++j) out.push_back(ins[r][j].op);
      if (i < (*seqs)[r].size()) out.push_back((*seqs)[r][i]);
    }
    (*seqs)[r] = std::move(out);
  }
  return Status::Ok();
}

}  // namespace pipeplan
